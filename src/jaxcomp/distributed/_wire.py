"""The rendezvous's wire: ``\\n``-terminated ASCII lines over a socket (or process 0's pipe to
the rendezvous server).

``HELLO <protocol> <num_processes> <process_id>`` from each process; ``GO``, ``MISSING <ids>``,
``WAITING <ids>`` (the answer to ``STATUS``), ``LOST <ids>``, ``STALLED <id> <seconds>`` or
``ERROR <text>`` from the server; ``PING`` from a process, about every second, and ``BYE`` from a
process leaving normally. The server says ``READY`` or ``FAILED <why>`` on its stdout once.
"""

from __future__ import annotations

import os
import re
import selectors
import socket
import time

# How a helper process (the rendezvous server, the quorum's service client) runs one of these
# files as a script: through runpy, so that the file's folder does not go first on sys.path, and
# not with ``-m``, since importing the package would import JAX (seconds).
RUN_THIS_FILE = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def parse_ids(words) -> list[int]:
    """The process ids in ``words`` (``["1,3"]``, ``["1", "3"]``), sorted, each once."""
    return sorted({int(t) for word in words for t in re.findall(r"\d+", word)})


class LineReader:
    """Reads ``\\n``-terminated ASCII lines from a socket or a pipe, with an optional deadline."""

    def __init__(self, source):
        self.source = source
        self.buffer = b""

    def readline(self, deadline):
        """The next line without its newline; None at EOF or when ``deadline`` (monotonic)
        passes."""
        while b"\n" not in self.buffer:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                with selectors.DefaultSelector() as selector:
                    selector.register(self.source, selectors.EVENT_READ)
                    if not selector.select(left):
                        continue
            chunk = (
                self.source.recv(4096)
                if isinstance(self.source, socket.socket)
                else os.read(self.source.fileno(), 4096)
            )
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode("ascii", "replace").strip()
