"""Running lowered programs: the LM training loop and evaluation (``train``), decoding
(``generate``), the ``meshtorch sample`` and ``meshtorch mnist`` jobs (``sample``, ``mnist``) and the
local process launcher of ``meshtorch launch`` (``launcher``). The command-line parsers that call
into these live in :mod:`meshtorch.cli`; data readers in :mod:`meshtorch.data`."""
