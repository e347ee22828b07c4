"""Decoding from a trained LM: greedy, temperature / top-k sampling, and beam search.

:func:`sample` decodes with a KV cache by default (:mod:`meshtorch.layers.kv_cache`): a decoder graph
(:func:`decoder_graph`: the model's prefill and one-token step programs, on the same mesh and layout as the
given lowering, with its weights copied in) runs the prompt once, then one position per new token; its
caches are laid out by the layout rules (``heads:model`` splits them). ``use_cache=False`` (and the
configurations without a cached decoder: pipelined or MoE native LMs) runs the whole fixed-shape graph
once per token instead (each token then costs a full forward pass over ``length`` positions). Beam search
(``transformers``' algorithm: finished hypotheses kept at EOS, :func:`beam_search_hypotheses`)
decodes through the same cache, each beam's cache rows following its parent (one reorder run per token).
T5 (an encoder-decoder, :func:`meshtorch.models.hf_t5_decoder.build_t5_decoder`) decodes through the same loop and
cache only: ``encoder_ids`` are the encoder's input (run once, in the prefill, with the encoder-decoder keys and
values), the prompt is the decoder's start (``[decoder_start_token_id]``).

Logits are fetched as full tensors and the choice is made on the host with a seeded ``torch.Generator``, so
for a given seed the tokens are the same under every mesh and layout, with or without the cache (the
logits agree to float tolerance).
"""

from __future__ import annotations

import torch

from meshtorch.models.decoding import build_lm_decoder
from meshtorch.models.hf import build_hf_decoder
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.hf_t5_decoder import build_t5_decoder
from meshtorch.models.transformer import LMConfig


def decoder_graph(lm):
    """The KV-cache decoder graph for ``lm``'s config (an ``LMGraph`` or an ``HFGraph``, T5 included), or None
    where there is none (pipelined models, MoE native LMs)."""
    c = lm.config
    if isinstance(c, LMConfig) and not c.pipelined and not any(c.is_moe_layer(i) for i in range(c.num_layers)):
        return build_lm_decoder(c)
    if isinstance(c, HFModelConfig) and not c.pipelined:
        return build_t5_decoder(c) if c.encoder_decoder else build_hf_decoder(c)
    return None


class CachedDecoder:
    """``lm``'s decoder graph lowered on ``lowering``'s mesh implementation, with ``lowering``'s weights.

    Built once per (lm, mesh implementation) and kept on ``lm``; :meth:`load` copies the weights again (they
    may have been trained since). It holds its own copy of the weights (laid out as ``lowering`` lays out its
    own), the caches, ``2 x layers x batch x heads x length x d_kv`` values, and the step's derived weights
    (:attr:`DecoderGraph.derived`: a Hugging Face head as ``[d_model, vocab]``, multi-head blocks' q/k/v kernels
    stacked; ~240 MB float32 at the GPT-2-small shape), which :meth:`refresh` keeps equal to their sources.
    """

    def __init__(self, lowering, lm, graph):
        self.graph = graph
        self.impl = lowering.mesh_to_impl[lm.mesh]
        self.lowering = graph.lowering(self.impl, mode=lowering.session.mode)
        self._refreshed = None  # the derived weights' sources as last refreshed from (:meth:`refresh`)

    @classmethod
    def of(cls, lowering, lm):
        """The decoder of ``lm`` on ``lowering`` (None where ``lm`` has none), weights copied from ``lowering``."""
        impl = lowering.mesh_to_impl[lm.mesh]
        dec = getattr(lm, "_cached_decoder", None)
        if dec is None or dec.impl is not impl:
            graph = decoder_graph(lm)
            if graph is None:
                return None
            dec = cls(lowering, lm, graph)
            lm._cached_decoder = dec
        dec.load(lowering)
        return dec

    def load(self, lowering):
        """Copy every weight of the decoder graph from ``lowering`` (full tensors, by variable name), then
        :meth:`refresh` the derived weights."""
        skip = set(self.graph.cache_names) | set(self.graph.derived)
        for name in self.lowering.variable_names:
            if name not in skip:
                self.lowering.set_variable_value(name, lowering.variable_value(name))
        self.refresh()

    def _sources(self) -> list:
        """``(slice, version counter)`` of every local slice of the derived weights' sources."""
        store = self.lowering.store
        out = []
        for name in sorted({n for names in self.graph.derived.values() for n in names}):
            v = store.values[name]
            out += [(None, 0)] if v is None else [(t, t._version) for t in store.impl(name).local_slices(v)]
        return out

    def refresh(self, force: bool = True):
        """Recompute the step's derived weights (:attr:`DecoderGraph.derived`: e.g. the contiguous
        ``[d_model, vocab]`` copy of a tied head) from the decoder's weights. ``force=False``: only if a
        source was replaced or written in place since the last refresh (the step checks this before every
        run, so a derived weight never lags behind its source, however the weights were set)."""
        if not self.graph.refresh_writes:
            return
        now = self._sources()
        if not force and self._refreshed is not None and len(now) == len(self._refreshed) and all(
                a is b and u == w for (a, u), (b, w) in zip(now, self._refreshed, strict=True)):
            return
        self.lowering.run(self.graph.refresh_writes)
        self._refreshed = now

    def prefill(self, buf: torch.Tensor, encoder_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``buf`` ``[batch, length]`` (the caches now hold its keys and values; an encoder-decoder's encoder
        runs on ``encoder_ids`` ``[batch, length]``, its keys and values cached too); its logits (float32).

        Raises:
            ValueError: ``encoder_ids`` missing for an encoder-decoder, or given for a decoder-only model."""
        g = self.graph
        if (g.encoder_ids is None) != (encoder_ids is None):
            raise ValueError("CachedDecoder.prefill: encoder_ids are the input of an encoder-decoder (T5) and only "
                             "of one.")
        feeds = {g.prefill_ids: buf} | ({} if encoder_ids is None else {g.encoder_ids: encoder_ids})
        return self.lowering.run([g.prefill_logits] + g.prefill_writes, feeds=feeds)[0].float()

    def step(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        """Run the tokens ``ids`` ``[batch]`` at ``position`` (written into the caches); next-token logits
        ``[batch, vocab]`` (float32).

        Raises:
            ValueError: naming the position, if it is not in ``0 .. length - 1``.
        """
        g = self.graph
        if not 0 <= position < g.config.length:
            raise ValueError(f"CachedDecoder.step: position {position} is outside the cache's 0.."
                             f"{g.config.length - 1}; past the context, prefill the slid window instead.")
        self.refresh(force=False)
        feeds = {g.step_ids: ids, g.position: torch.tensor(position, dtype=torch.int32)}
        return self.lowering.run([g.step_logits] + g.step_writes, feeds=feeds)[0].float()

    def reorder(self, src: torch.Tensor):
        """Make row ``b`` of every cache the old row ``src[b]`` (int64 ``[batch]``)."""
        g = self.graph
        self.lowering.run(g.reorder_writes, feeds={g.reorder_src: src})


class _NextLogits:
    """Next-token logits ``[batch, vocab]`` (float32, padding stripped) for the token buffer, with the cache
    (a prefill for the prompt, or past the context for each slid window; else one step) or without."""

    def __init__(self, lowering, lm, use_cache: bool, encoder_ids: torch.Tensor | None = None):
        self.lowering, self.lm, self.encoder_ids = lowering, lm, encoder_ids
        if encoder_ids is not None and not use_cache:
            raise ValueError("generate: an encoder-decoder (T5) decodes with the KV cache only (use_cache=True).")
        self.dec = CachedDecoder.of(lowering, lm) if use_cache else None
        self.fresh = True  # the caches do not hold the window yet

    def __call__(self, buf: torch.Tensor, t: int, slid: bool) -> torch.Tensor:
        vocab = self.lm.config.vocab_size
        if self.dec is None:
            return _next_logits(self.lowering, self.lm, buf, t)
        if self.fresh or slid:
            self.fresh = False
            return self.dec.prefill(buf, self.encoder_ids)[:, t - 1, :vocab]
        return self.dec.step(buf[:, t - 1], t - 1)[:, :vocab]


def _next_logits(lowering, lm, buf: torch.Tensor, t: int) -> torch.Tensor:
    logits = lowering.run(lm.logits, feeds={lm.inputs: buf, lm.targets: buf})
    return logits[:, t - 1, : lm.config.vocab_size].to(torch.float32)


def _prepare(lm, prompt_ids, rows: int):
    c = lm.config
    prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).flatten()
    if len(prompt) == 0:
        raise ValueError("generate: the prompt must hold at least one token.")
    if len(prompt) >= c.length:
        raise ValueError(f"generate: prompt of {len(prompt)} tokens leaves no room in a sequence of {c.length}.")
    if rows > c.batch_size:
        raise ValueError(f"generate: {rows} rows do not fit in the graph's batch of {c.batch_size}.")
    buf = torch.zeros(c.batch_size, c.length, dtype=torch.int64)
    buf[:, : len(prompt)] = prompt
    return buf, len(prompt)


def _encoder_feed(lm, encoder_ids, rows: int, prompt_len: int, max_new_tokens: int) -> torch.Tensor | None:
    """An encoder-decoder's encoder input ``[batch, length]`` (``encoder_ids``: ``[rows, n]``, or 1-D for every row;
    n <= length; padded with 0), or None for a decoder-only model.

    Raises:
        ValueError: naming the argument: ``encoder_ids`` missing (T5), given (decoder-only), of other rows or longer
            than the graph's length; or a T5 decode past the decoder's window (no sliding: relative positions)."""
    c = lm.config
    if not getattr(c, "encoder_decoder", False):
        if encoder_ids is not None:
            raise ValueError("generate: encoder_ids are for an encoder-decoder model (T5); this model has no encoder.")
        return None
    if encoder_ids is None:
        raise ValueError("generate: an encoder-decoder model (T5) needs encoder_ids (the encoder's input).")
    x = torch.as_tensor(encoder_ids, dtype=torch.int64)
    x = x[None].expand(rows, -1) if x.dim() == 1 else x
    if x.dim() != 2 or x.shape[0] != rows or not 0 < x.shape[1] <= c.length:
        raise ValueError(f"generate: encoder_ids {tuple(x.shape)} must be [{rows} rows, 1..{c.length} ids].")
    if prompt_len + max_new_tokens > c.length:
        raise ValueError(f"generate: {prompt_len} + {max_new_tokens} decoder positions exceed T5's window of "
                         f"{c.length}; build the graph with length >= {prompt_len + max_new_tokens}.")
    out = torch.zeros(c.batch_size, c.length, dtype=torch.int64)
    out[:rows, :x.shape[1]] = x
    return out


def _slide(buf: torch.Tensor, t: int) -> int:
    """Make room for the token at position ``t``: past the context, drop the oldest token (sliding window)."""
    if t < buf.shape[1]:
        return t
    buf[:, :-1] = buf[:, 1:].clone()
    return buf.shape[1] - 1


def sample(lowering, lm, prompt_ids, max_new_tokens: int = 64, temperature: float = 1.0, top_k: int = 0,
           seed: int = 0, num_samples: int = 1, progress=None, eos_ids=(), use_cache: bool = True,
           encoder_ids=None) -> list[list[int]]:
    """Sample continuations of ``prompt_ids``; ``temperature=0`` is greedy decoding. A sample ends at its first
    token in ``eos_ids`` (kept, as ``transformers.generate`` keeps it); decoding stops when every sample ended.

    Past the model's context (``length``) the window slides: each new token is predicted from the last
    ``length - 1`` tokens (with the cache: by a prefill of that window per token, as learned positions
    shift).

    Args:
        progress: optional callable, called once per generated token (e.g. a tqdm bar's ``update``).
        lowering / lm: a Lowering of an :class:`~meshtorch.models.transformer.LMGraph`.
        prompt_ids: token ids (1-D).
        top_k: keep only the ``top_k`` most likely tokens (0: all).
        num_samples: independent samples (rows of the batch), at most the graph's batch size.
        eos_ids: end-of-sequence token ids (e.g. ``config.json``'s ``eos_token_id``); () decodes
            ``max_new_tokens`` tokens.
        use_cache: decode with the KV cache (:class:`CachedDecoder`) where ``lm`` has one; False: one
            full-graph run per token.
        encoder_ids: an encoder-decoder's (T5's) encoder input, int ``[num_samples, n]`` (one row per sample) or 1-D
            (every sample), ``n <= length``, 0 padding; ``prompt_ids`` is then the decoder's start
            (``[decoder_start_token_id]``) and the decoder's window holds it and ``max_new_tokens``.

    Returns:
        ``num_samples`` lists of generated token ids (prompt excluded).
    """
    buf, t = _prepare(lm, prompt_ids, num_samples)
    enc = _encoder_feed(lm, encoder_ids, num_samples, t, max_new_tokens)
    next_logits = _NextLogits(lowering, lm, use_cache, enc)
    gen = torch.Generator().manual_seed(seed)
    out = [[] for _ in range(num_samples)]
    eos, done = {int(e) for e in eos_ids}, [False] * num_samples
    for _ in range(max_new_tokens):
        if all(done):
            break
        t_before, t = t, _slide(buf, t)
        logits = next_logits(buf, t, t != t_before)
        logits = logits[:num_samples].cpu()  # chosen on the host, any device
        if temperature <= 0:
            nxt = logits.argmax(-1)
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
        buf[:num_samples, t] = nxt
        for i in range(num_samples):
            if not done[i]:
                out[i].append(int(nxt[i]))
                done[i] = int(nxt[i]) in eos
        t += 1
        if progress is not None:
            progress()
    return out


def beam_search_hypotheses(lowering, lm, prompt_ids, beam_size: int = 4, max_new_tokens: int = 32, eos_ids=(),
                           length_penalty: float = 1.0, early_stopping: bool | str = False, progress=None,
                           use_cache: bool = True, encoder_ids=None) -> list[tuple[float, list[int]]]:
    """Beam search with end-of-sequence handling, as ``transformers``' ``GenerationMixin._beam_search`` (v5,
    ``transformers/generation/utils.py``; its ``BeamSearchScorer`` before): the finished hypotheses, best first.

    Each step takes the ``K = max(2, 1 + len(eos_ids)) x beam_size`` best candidates (summed log-probabilities) of
    all beams' next tokens. Those of the first ``beam_size`` that end the sequence (a token in ``eos_ids``, kept;
    or the ``max_new_tokens``-th token) enter the finished set, scored ``sum log p / n ** length_penalty`` with ``n``
    the hypothesis' new tokens (EOS included), which keeps the ``beam_size`` best; the ``beam_size`` best candidates
    that do not end continue (so a beam ending in EOS is never extended). Decoding stops when every candidate
    ended, or (``early_stopping`` True) as soon as the finished set is full, or when it is full and the best
    continuing beam cannot beat its worst: ``early_stopping`` False (``transformers``' default) scores that beam at
    its current length, ``"never"`` at ``max_new_tokens`` where ``length_penalty`` > 0 (the canonical search).

    Beams are rows of the graph's batch. Past the model's context the window slides (as :func:`sample`);
    ``progress`` is called per token. With the cache (``use_cache``, as :func:`sample`) each beam's cache rows
    follow its parent (:meth:`CachedDecoder.reorder`). ``encoder_ids``: a T5's encoder input (1-D,
    :func:`sample`'s), the same for every beam; ``prompt_ids`` is then the decoder's start.

    Returns:
        ``[(score, new token ids)]`` of the finished hypotheses (``generate(num_beams=beam_size,
        num_return_sequences=beam_size)``'s ``sequences_scores`` and sequences without the prompt), best first.

    Raises:
        ValueError: naming the argument: ``beam_size`` < 1, ``max_new_tokens`` < 1, or ``early_stopping`` not
            True, False or ``"never"``; and :func:`sample`'s prompt / ``encoder_ids`` errors.
    """
    if beam_size < 1 or max_new_tokens < 1:
        raise ValueError(f"beam_search: beam_size {beam_size} and max_new_tokens {max_new_tokens} must be >= 1.")
    if not any(early_stopping is v for v in (True, False)) and early_stopping != "never":
        raise ValueError(f"beam_search: early_stopping {early_stopping!r} must be True, False or 'never' "
                         f"(transformers' GenerationConfig.early_stopping).")
    buf, t = _prepare(lm, prompt_ids, beam_size)
    enc = _encoder_feed(lm, encoder_ids, beam_size, t, max_new_tokens)
    next_logits = _NextLogits(lowering, lm, use_cache, enc)
    eos = torch.tensor(sorted({int(e) for e in eos_ids}), dtype=torch.int64)
    keep = max(2, 1 + len(eos)) * beam_size
    top_beams = torch.arange(keep) < beam_size  # only these candidates may enter the finished set
    # running beams: new tokens and summed log-probabilities (all beams start equal: expand only the first)
    running = torch.full((beam_size, max_new_tokens), -1, dtype=torch.int64)
    run_scores = torch.full((beam_size,), -1e9)
    run_scores[0] = 0.0
    # the finished set: new tokens, length-penalised scores, lengths, and which slots hold a hypothesis
    seqs, fin_scores = running.clone(), torch.full((beam_size,), -1e9)
    fin_len, finished = torch.zeros(beam_size, dtype=torch.int64), torch.zeros(beam_size, dtype=torch.bool)
    improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
    for n in range(max_new_tokens):  # n tokens decoded so far
        t_before, t = t, _slide(buf, t)
        logp = torch.log_softmax(next_logits(buf, t, t != t_before)[:beam_size].cpu(), -1)
        vocab = logp.shape[-1]
        top_lp, idx = (logp + run_scores[:, None]).flatten().topk(min(keep, beam_size * vocab))
        parent, tok = idx // vocab, idx % vocab
        cand = running[parent]
        cand[:, n] = tok
        ends = torch.isin(tok, eos) | (n + 1 == max_new_tokens)  # EOS, or the length limit
        # the continuing beams: the best candidates that did not end
        live = top_lp + ends.float() * -1e9
        nxt = live.topk(beam_size).indices
        running, run_scores, run_parent = cand[nxt], live[nxt], parent[nxt]
        # the finished set: the best of itself and the top beam_size candidates that ended
        scored = top_lp / float(n + 1) ** length_penalty
        blocked = (not improvable) or (early_stopping is True and bool(finished.all()))
        new = ends & top_beams[:len(ends)]
        scored = scored + (~new).float() * -1e9 + float(blocked) * -1e9
        pick = torch.cat([fin_scores, scored]).topk(beam_size).indices
        seqs, fin_scores = torch.cat([seqs, cand])[pick], torch.cat([fin_scores, scored])[pick]
        fin_len = torch.cat([fin_len, torch.full((len(cand),), n + 1)])[pick]
        finished = torch.cat([finished, new])[pick]
        if progress is not None:
            progress()
        # can a continuing beam still beat the worst finished one?
        hyp_len = max_new_tokens if early_stopping == "never" and length_penalty > 0 else n + 1
        worst = torch.where(finished, fin_scores.min(), torch.tensor(-1e9))
        improvable = improvable and bool((run_scores[0] / float(hyp_len) ** length_penalty > worst).any())
        if not improvable or (early_stopping is True and bool(finished.all())) or bool(ends.all()):
            break
        buf[:beam_size] = buf[run_parent].clone()
        buf[:beam_size, t] = running[:, n]
        if next_logits.dec is not None:
            rows = torch.arange(buf.shape[0])
            rows[:beam_size] = run_parent
            next_logits.dec.reorder(rows)
        t += 1
    return [(float(fin_scores[i]), seqs[i, :int(fin_len[i])].tolist()) for i in range(beam_size) if finished[i]]


def beam_search(lowering, lm, prompt_ids, beam_size: int = 4, max_new_tokens: int = 32, eos_ids=(),
                length_penalty: float = 1.0, early_stopping: bool | str = False, progress=None,
                use_cache: bool = True, encoder_ids=None) -> list[int]:
    """The best hypothesis' new token ids (its EOS kept) of :func:`beam_search_hypotheses` (same arguments): what
    ``transformers.generate(num_beams=beam_size, length_penalty=..., early_stopping=...)`` returns after the
    prompt, padding stripped. With no ``eos_ids`` every hypothesis has ``max_new_tokens`` tokens (the best summed
    log-probability, whatever ``length_penalty``)."""
    hyps = beam_search_hypotheses(lowering, lm, prompt_ids, beam_size, max_new_tokens, eos_ids, length_penalty,
                                  early_stopping, progress, use_cache, encoder_ids)
    return hyps[0][1]
