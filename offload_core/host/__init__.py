"""Host memory: where streamed weights wait between uses, and how much of it a replica may spend.

Owns the hosting tiers (PINNED / PAGEABLE / MAPPED), host RAM (psutil, cgroups, reserve),
``/proc/self/maps``, exact-size pinning, the lease-based budget and the per-layer hosting plan.
"""
