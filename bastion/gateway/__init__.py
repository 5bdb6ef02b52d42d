"""The gateway: one lifetime, the request path, the agent and operator doors, outbound SSH."""
