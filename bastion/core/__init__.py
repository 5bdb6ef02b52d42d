"""The audited core: where bastion decides, and the records it decides over.

`gate` (the decision: a request in a world to a verdict, every refusal of the
request path), `refusals` (what the edges may say of what they observed, and
its code), `opguard` (who may speak for the operator), `policy` (the policy
model), `files` (file operations and the paths an account may read and write),
`command` (a command read as the target's shell reads it), `subject` (who asks,
and where the subject stands in a process chain), `binding` (what a yes is
bound to), `stdin` (an agent's stdin on a command card), `certs` (what a
per-command certificate says), `cards` (what a person is asked), `waiting`
(what an agent is shown while its card waits), `contract` (what an agent is
told: codes, exit statuses, the `Refusal`), `errors` (the root exception),
`events` (the journal's vocabulary and its folds), `display` (what a person is
shown), `options` (options that run programs), `sharing` (what an agent is told
of a shared ssh connection), `terminal` (the terminal an ssh client asked for),
`grants` (bounded grants: a yes widened to an argv pattern, for uses or
minutes), `presence` (approvals signed by an enrolled authenticator over the
exact card, and the one check of such a signature), `concurrency` (how many
commands one target serves well at once, learned from their times),
`defaults` (every tunable, once).

Every module here holds pure functions, immutable records and enums only, and
imports the standard library's pure parts and `cryptography` only -- no
asyncio, no asyncssh, no psutil, no sockets, no file I/O
(`tests/unit/test_architecture.py` checks the imports of every module in this
package). The gateway, the CLI and the journal are shells around it; see
docs/architecture.md, "The rooms".
"""
