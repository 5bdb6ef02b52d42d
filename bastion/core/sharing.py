"""What an agent is told of a shared ssh connection (`gate.not_shareable` decides).

A ControlMaster carries, on one connection, the commands of every process that
reaches its control socket: inside one registered run that is the run asking;
from outside it, or from another run, it would be someone else riding the run's
approval. Kept apart from the gate only for its length.
"""

from __future__ import annotations

IN_A_RUN = (
    "Inside one `bastion run`, a ControlMaster is shared by the processes of that run "
    "(ansible's default ControlMaster=auto works there)."
)
MUX_OUTSIDER = (
    "This command came through an ssh ControlMaster of a registered run, and {seen}: a "
    "ControlMaster carries the commands of its own run's processes only, never those of a "
    "process outside the run or of another run, which would run on this run's approval. "
    "Nothing was sent. Send it from inside the run that started the master, or run ssh "
    "without sharing: -o ControlMaster=no -o ControlPath=none."
)
MUX_UNSEEN = (
    "This command came through an ssh ControlMaster of a registered run, and the gateway "
    "could not see which processes are connected to the master ({seen}), so it cannot tell "
    "that they all belong to the run. Nothing was sent. Run ssh without sharing: -o "
    "ControlMaster=no -o ControlPath=none (in an --isolated run, sharing needs a gateway "
    "that runs as root, which can read the agent user's processes)."
)
