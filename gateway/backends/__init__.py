"""The backends behind the gateway: one backend and its ring (`backend`), the pool of them (`pool`), routing
(`route`), and the transports that reach a ring (`transports`, `tcp_producer`)."""
