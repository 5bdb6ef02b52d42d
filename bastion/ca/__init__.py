"""Who signs per-command certificates: the gateway's side of the trust boundary.

A certificate account's login is signed here and nowhere else: `vault_ca` (the
vault's own user CA: its labels, init, rotate, retire, the `ca public` text,
and `sign`, the one place a certificate is made from a `CertSpec`), `issuer`
(the `Issuer` protocol the gateway calls, and `VaultCA`), `openbao` (OpenBao's
SSH engine as an `Issuer`). It holds signing keys, or the login that reaches
them, so only the gateway and the operator's own offline commands (`ops`)
import it; the agent side never does.
"""
