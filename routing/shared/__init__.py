"""State shared by several gateway processes through Redis (`CROSSBAR_REDIS_URL`).

`state.Shared` is one process's connection, id and liveness; on it, `slots.RedisSlots` (the
limiter's slots and FIFO queues), `leases.RedisLeases` (conversation leases) and
`clients.RedisClients` (client keys' concurrency and per-minute counts). Without Redis the
gateway uses the in-process equivalents in routing/core, which never import this package.
See docs/replicas.md.
"""
