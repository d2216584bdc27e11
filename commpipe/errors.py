"""One report per error, also when torchrun starts one process per rank.

Under torchrun every rank runs the same command-line checks, so a bad flag fails on every rank
at once. The first rank of each node reports it; the others leave quietly with the same exit
code a moment later, so that torchrun takes the reporting rank as the root cause.

torchrun prints a summary of failed workers after they have all exited, and reads each worker's
message from the file named by TORCHELASTIC_ERROR_FILE (the protocol behind
`torch.distributed.elastic.multiprocessing.errors.record`). The reporting rank writes its
message there instead of to stderr: it then appears once, in the summary's root-cause block,
the last thing the job prints. Without torchrun the message goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time

# the quiet ranks leave after the reporting one: torchrun polls its workers every 0.1 s
QUIET_EXIT_DELAY_S = 2.0


def multi_process() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def is_reporter() -> bool:
    """The first process of its node (of the job, on one node) reports shared errors."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def report(text: str) -> None:
    """Show `text` once: in torchrun's failure summary when this is a torchrun worker, else on
    stderr (also when the file cannot be written)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                # the layout record() writes; without a py_callstack torchrun shows the message
                json.dump({"message": {"message": text,
                                       "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
            return
        except OSError:
            pass
    print(text, file=sys.stderr, flush=True)


def report_shared(text: str) -> None:
    """An error every rank met the same way (a flag, a missing file): reported by one rank;
    the others wait so that the reporting rank is the first to exit."""
    if not multi_process():
        print(text, file=sys.stderr, flush=True)
    elif is_reporter():
        report(text)
    else:
        time.sleep(QUIET_EXIT_DELAY_S)
