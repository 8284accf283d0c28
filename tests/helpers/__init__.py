"""What the tests share: helpers any test module imports (fixtures live in the conftest.py
nearest the tests that use them; the fake llama-server and its kin in tests/fakes/).

- `machine`: the checkout's root, a free local port.
- `waits`: waiting on a condition (`wait_until`, and `eventually` for coroutines).
- `gateway`: crossbar as users run it, on a real server (`running_gateway`, `signed_in`).
- `redis_server`: a real redis-server of a test's own, and a second process holding in it.
- `fleet`: hosts and routes in the test database, as an operator adds them; chat bodies.
- `wire`: HTTP/1.1 by hand over a socket.
- `asking`: asking the gateway for chats, and reading what came back (rows, events).
- `observe`: waiting until the gateway has seen something, read where an operator reads it.
- `invariants`: the `Ledger` a fault test settles: nothing held, nothing lost.
- `conversation`: a conversation through the gateway, turn by turn.
- `memory_fleet`: placement's fleet over plain dicts, with a real limiter and lease table.
- `request_path`: the stateful model of the request path (Hypothesis).
- the rest, one job each: `browser`, `history_records`, `request_rows`, `route_form`,
  `config_file`, `database`, `relay`, `sse_streams`, `priced_patience`, `soak`.
"""
