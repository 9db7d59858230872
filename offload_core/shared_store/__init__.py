"""The node weight store: one read-only host copy of a model's streamed layers for every replica on a node.

- ``files``: a store's key (folder identity, dtype, layout) and its files under the node's store
  directory, created once, locked while written;
- ``store``: a store's bytes (a file-backed shared mapping), written by the first replica, mapped
  read-only by the others;
- ``registry``: how a replica asks for a store and leases its bytes once per node (the node ledger's
  side implements it: ``cluster/ledger/shared_stores.py``, called by the ledger actor);
- ``hosting``: which of a component's streamed layers are hosted from a store (the engine's side);
- ``layer``: a streamed layer whose host bytes are a view of the store.

Run by each stage replica (engine and host side) and, through ``registry``, by the node ledger.
"""
