"""A child for tests/sdk/test_forkserver.py: prints what a ``python -m`` child sees, then exits with the code
given as its first argument (or sleeps when it is ``sleep``)."""

import gc
import os
import sys
import time

print(f"argv={sys.argv[1:]} cwd={os.getcwd()} marker={os.environ.get('FORKED_MARKER')} "
      f"main={__name__} sid={os.getsid(0) == os.getpid()} stdin={sys.stdin.read()!r}", flush=True)
# what the server preloaded: a gateway's routes imported, and the heap it left out of the collector's scans
print(f"routes={'tracegym.gateway.api.control' in sys.modules} frozen={gc.get_freeze_count() > 10000}", flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
