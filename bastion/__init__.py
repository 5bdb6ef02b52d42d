"""bastion: a local SSH bastion that brokers the commands of AI agents.

Kept import-free on purpose: the ProxyCommand helper runs on every agent
command and must not pay for asyncssh or click.
"""

__version__ = "0.1.0"
