"""Clients tier: third-party clients through a real gateway to the real sshd.

The tools agents reach for that are not the stock `ssh` run here as an agent runs
them: their own client code, the config `bastion ssh-config` prints, inside `bastion
run` where that is how an agent would start them. The rootdir conftest's `bastion`
fixture (a gateway running and unlocked, a policy for `web1` to the test sshd) is the
base.
"""
