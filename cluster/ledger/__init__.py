"""The node ledger's side, in the ledger actor's own process (one named actor per Ray node): the
pools of host RAM and each GPU's memory, leases per owner process, liveness of the owners, and the
node's shared weight stores. Imports nothing of the replica's side."""
