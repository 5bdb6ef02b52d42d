"""The identity room: who is asking, observed from the kernel, never from a client.

- `resolver`: peer credentials, the process chain and the subject; this face names its
  public names. `core/subject` decides; this room observes.
- `images`: what a process runs (the sha256 of its executable, which exec it is in).
- `procs`: the little the gateway reads of a process besides that walk: one line of
  /proc/PID/stat, the boot id, and whether it is sandboxed (its namespaces).
- `netns`: a socket made in a run's own network namespace (by a child that joins it),
  for the kernel's tables of that namespace (the ControlMaster observation).
- `tcp_peers`: who holds the other end of a loopback TCP connection (the console's
  peers): the peer's socket by the 4-tuple (sock_diag), then its holder in /proc/PID/fd.
"""

from bastion.identity.resolver import (
    DEFAULT_TERMINAL_HOSTS,
    DEFAULT_WRAPPERS,
    SO_PEERPIDFD,
    IdentityError,
    Resolver,
    alive,
    children,
    descends_from,
    name_matcher,
    peer_credentials,
    peer_pidfd,
    pidfd_exited,
    serves_control_socket,
    ssh_client_of,
)

__all__ = [
    "DEFAULT_TERMINAL_HOSTS",
    "DEFAULT_WRAPPERS",
    "SO_PEERPIDFD",
    "IdentityError",
    "Resolver",
    "alive",
    "children",
    "descends_from",
    "name_matcher",
    "peer_credentials",
    "peer_pidfd",
    "pidfd_exited",
    "serves_control_socket",
    "ssh_client_of",
]
