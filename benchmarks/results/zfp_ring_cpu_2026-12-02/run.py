"""python run.py MODEL METHOD OPTIONS OUTDIR: host.py as 4 processes on 127.0.0.1."""

import pathlib
import sys

from jaxcomp.distributed import launch

HOST = str(pathlib.Path(__file__).with_name("host.py"))
sys.exit(launch.launch([HOST, *sys.argv[1:]], num_processes=4, allocator="tuned", timeout=600))
