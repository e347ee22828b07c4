"""The collective kinds' records, for the lowering passes: declared once in :mod:`meshtorch.core.collectives`
(which the backends are checked against when their class is defined), re-exported here."""

from meshtorch.core.collectives import BUCKETS, KINDS, CollectiveKind, is_collective, kind_of

__all__ = ["BUCKETS", "KINDS", "CollectiveKind", "is_collective", "kind_of"]
