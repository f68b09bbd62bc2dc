"""One logged step walks through few rooms: traced with ``sys.setprofile`` on every thread, a
logged step of a 2-layer model (``optimizer=``, a memory sink, the defaults) enters at most 12
of gradtrack's files on the training thread and 15 on the worker (docs/architecture.md draws
that path). A step path that spreads over more files than a newcomer can follow fails here
by the files it entered.

The trace runs in a child process, so that no other test's threads or imports are counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

TRAINING_FILES = 12
WORKER_FILES = 15

TRACE = textwrap.dedent(
    """
    import collections, json, os, sys, threading
    import torch
    from torch import nn
    import gradtrack

    package = os.path.dirname(gradtrack.__file__)
    tracing = {"training": False, "others": False}
    entered = collections.defaultdict(set)

    def profile(frame, event, arg):
        if event != "call":
            return
        thread = threading.current_thread()
        main = thread is threading.main_thread()
        path = frame.f_code.co_filename
        if tracing["training" if main else "others"] and path.startswith(package):
            entered["training" if main else thread.name].add(os.path.relpath(path, package))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    threading.setprofile(profile)  # (the worker and couriers start inside watch)
    sys.setprofile(profile)
    watcher = gradtrack.watch(model, "memory", optimizer)
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def step():
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(watcher.config.log_every):  # step 0 (logged, the first) and the quiet ones
        step()
    watcher.flush()
    tracing.update(training=True, others=True)
    step()  # a logged step
    tracing["training"] = False
    watcher.flush()  # the worker and the sink's courier deliver it
    tracing["others"] = False
    sys.setprofile(None)
    threading.setprofile(None)
    records = watcher.sinks[0].records
    watcher.close()
    assert records[-1].step == watcher.config.log_every, [r.step for r in records]
    print(json.dumps({name: sorted(files) for name, files in entered.items()}))
    """
)


def test_one_logged_step_enters_few_files_per_thread() -> None:
    done = subprocess.run(
        [sys.executable, "-c", TRACE], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    entered = json.loads(done.stdout.strip().splitlines()[-1])
    training, worker = entered["training"], entered["gradtrack-worker"]
    assert len(training) <= TRAINING_FILES, training
    assert len(worker) <= WORKER_FILES, worker
    # The step's path runs in capture/ and hands off through handoff/; the watcher, the
    # worker and delivery are not entered on the training thread.
    assert all(path.startswith(("capture/", "handoff/")) for path in training), training
