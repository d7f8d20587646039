import sys
from jaxcomp.distributed import launch
sys.exit(launch.launch(["/tmp/prof/host.py"] + sys.argv[1:], num_processes=4, allocator="tuned", timeout=600))
