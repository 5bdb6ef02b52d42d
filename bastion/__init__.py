"""bastion: a local SSH bastion that brokers the commands of AI agents.

Kept import-free on purpose: the ProxyCommand helper runs on every agent
command and must not pay for asyncssh or click (``warnings`` is loaded by
the interpreter itself before any of our code runs).
"""

import warnings

__version__ = "0.1.0"

# Recent cryptography releases warn, at import time, about the DSA types asyncssh names in
# its signatures. bastion never loads a DSA key (vault_file refuses them), and a
# CLI promises one `bastion: ` line on stderr, so this one warning is silenced
# where it is raised and nowhere else.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh(\.|$)")
