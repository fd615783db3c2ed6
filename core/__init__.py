"""The floor of hermes-gateway: what every layer may import and that imports nothing of
the project (settings, message types and adapter protocols, the command table, text
splitting, the `Lane` value, shared errors, backoff and redaction).

See docs/development.md#layers.
"""
