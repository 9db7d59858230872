"""The node weight store: one read-only host copy of a model's streamed layers for every replica on a node.

- ``files``: a store's key (folder identity, dtype, layout) and its files under the node's store
  directory, created once, locked while written;
- ``store``: a store's bytes (a file-backed shared mapping), written by the first replica, mapped
  read-only by the others;
- ``registry``: how a replica asks for a store and leases its bytes once per node (over the node
  ledger: ``cluster/ledger/shared_stores.py``);
- ``ledger_record``: the node ledger's record of its stores (one lease per copy, who is attached),
  which the ledger actor calls into;
- ``hosting``: which of a component's streamed layers are hosted from a store (the engine's side);
- ``layer``: a streamed layer whose host bytes are a view of the store.

Run by each stage replica (engine and host side) and by the node ledger's actor (``ledger_record``).
"""
