"""Relays: the WebSocket and HTTP paths from client to replica.

The package owns an admitted session's bytes, from the client's request head to the
end-of-session record. Its parts:

* the client listener (:mod:`~proxy.relay.listener`): reads every request head itself;
  a WebSocket handshake goes to Headroom's own WebSocket server side, anything else to
  uvicorn's HTTP protocol;
* what both relays share: :mod:`~proxy.relay.lifecycle` (one session from start to end:
  authorize, prepare, admit, wait, connect, relay, release and log), :mod:`~proxy.relay.admit`
  (the gate, the opt-in fallback pool, Headroom's own query parameters),
  :mod:`~proxy.relay.failover` (connecting to a pool's replicas with bounded failover),
  :mod:`~proxy.relay.deadlines` (the session timers), :mod:`~proxy.relay.headers` (which
  headers cross the proxy), :mod:`~proxy.relay.services` (the narrow interface to the
  gateway the relays hold) and :mod:`~proxy.relay.session_record` (the end-of-session
  log line);
* the WebSocket relay: :mod:`~proxy.relay.ws_session` (one client session from
  handshake to close), :mod:`~proxy.relay.ws_server` and :mod:`~proxy.relay.ws_handshake`
  (the client's handshake checked and answered, and its socket taken over),
  :mod:`~proxy.relay.upstream_handshake` (the handshake to the replica),
  :mod:`~proxy.relay.splice` and :mod:`~proxy.relay.splice_leg` (the hot path: each
  socket's frames walked and forwarded to the other as they are read),
  :mod:`~proxy.relay.wsframes` (RFC 6455 framing, pure), and the session rules with no
  I/O: :mod:`~proxy.relay.relay_core`, the state it keeps
  (:mod:`~proxy.relay.session_states`) and the actions it asks of its shell
  (:mod:`~proxy.relay.session_actions`);
* the HTTP relay: :mod:`~proxy.relay.http_session` (the streaming relay over one pooled
  httpx client), :mod:`~proxy.relay.http_exchange` (one admitted exchange: the request
  sent upstream, the response streamed back, the limits that end it) and
  :mod:`~proxy.relay.http_body` (request bodies read under bounds, the control plane's
  too);
* :mod:`~proxy.relay.library_contract`: the one module that uses names uvicorn and
  websockets do not publish.
"""
