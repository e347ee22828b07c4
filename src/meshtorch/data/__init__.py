"""Data helpers: which examples each process reads (:mod:`meshtorch.data.sharding`)."""
