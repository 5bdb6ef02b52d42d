"""The clients tier: third-party clients through a real gateway to the real sshd."""
