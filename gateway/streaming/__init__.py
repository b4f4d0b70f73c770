"""How tokens get from a ring to the clients: the poller (`poller`), one request in flight (`request_handle`), the
poller's round in C for plain streams (`stream_round`, `native`, `csrc/`) and set-ups taking turns with it
(`pacing`)."""
