"""The replica's side of the node ledger, in each stage replica's process: its view of the ledger
(host budget, its GPU's pool, the neighbours' leases, the store registry), the client that leases
through the actor, the device leases around each call, and the plan made from what it sees."""
