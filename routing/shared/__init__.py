"""State shared by several gateway processes through Redis (`CROSSBAR_REDIS_URL`).

`state.Shared` is one process's connection, id and liveness; on it, `slots.RedisSlots` (the
limiter's slots and FIFO queues: the operations, with its book in `holdings`, its limits in
`slot_limits`, its grant listener in `wakes` and its restore path in `slot_recovery`),
`leases.RedisLeases` (conversation leases) and `clients.RedisClients` (client keys'
concurrency and per-minute counts). `fleet_state.SharedState` puts them behind placement's
`FleetState`, with `places` (what a request holds) and `counts` (what rankings read). Without
Redis the gateway uses the in-process equivalents in routing/core, which never import this
package. See docs/replicas.md.
"""
