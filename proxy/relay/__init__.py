"""Relays: the WebSocket and HTTP paths from client to replica."""
