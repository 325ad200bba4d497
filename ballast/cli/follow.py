"""Following a job's events (`ballast watch`, `submit --wait`, the demo): state changes as they come, and a
live bar while it trains.

Apart from `submit` so that the demo, which follows the jobs it submits, imports it without importing the
submit command.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import grpc
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn
from rich.status import Status

from ballast.cli.fleet import predicted_start, reason_words
from ballast.client import Client
from ballast.sdk import BAD_END, ORDER, STATES, S
from ballast.v1 import job_pb2, services_pb2, store_pb2

console = Console()
err = Console(stderr=True)
TRAINING = (S.JOB_STATE_RUNNING, S.JOB_STATE_REPARTITIONING)  # the progress bar stays up through migrations
COLOURS = {S.JOB_STATE_REPARTITIONING: "magenta", S.JOB_STATE_FAILED: "red", S.JOB_STATE_CANCELLED: "yellow",
           S.JOB_STATE_SUCCEEDED: "green", S.JOB_STATE_QUEUED: "blue", S.JOB_STATE_MORPHING: "yellow"}
CLASS_EVENTS = ("QUEUED", "ADMITTED", "RESUMED")  # shared-fleet events whose message leaves out the priority class
EVENT_COLOURS = {"PREEMPTING": "yellow", "PREEMPTED": "yellow", "ADMITTED": "green", "RESUMED": "green",
                 "MORPHING": "yellow", "STRAGGLER": "yellow", "MORPHED": "green", "EVALUATED": "cyan"}
QUEUE_POLL_S = 2.0  # how often the "queued" line asks the planner for the job's place in the queue


def add_follow_arguments(p: argparse.ArgumentParser, wait_help: str | None) -> None:
    if wait_help:
        p.add_argument("--wait", action="store_true", help=wait_help)
    p.add_argument("--until", choices=[s for s in STATES if STATES[s] in ORDER[1:]], default=None,
                   help="stop following once the job reaches this state (e.g. scheduled)")


def follow(client: Client, job_id: str, after: int, until: str | None) -> int:
    """Print events as they come, with a live bar (step, loss, samples/s) while the job trains; exit 0 at
    SUCCEEDED (or the --until state), 1 at FAILED or CANCELLED."""
    target = STATES[until] if until else S.JOB_STATE_SUCCEEDED
    events: queue.Queue = queue.Queue()
    stream = client.jobs.Watch(services_pb2.WatchJobRequest(job_id=job_id, after_seq=after), timeout=None)

    def pump() -> None:
        try:
            for event in stream:
                events.put(event)
        except grpc.RpcError as exc:
            events.put(exc)
        events.put(None)

    threading.Thread(target=pump, name="watch", daemon=True).start()
    bar: Progress | None = None  # shown only while the job trains
    task = None
    waiting: Status | None = None  # shown only while the job is queued: its place, reason and predicted start
    polled = 0.0
    try:
        while True:
            try:
                item = events.get(timeout=0.5)
            except queue.Empty:
                if bar is not None:
                    _progress(client, job_id, bar, task)
                if waiting is not None and time.monotonic() - polled >= QUEUE_POLL_S:
                    polled = time.monotonic()
                    waiting.update(queue_line(client, job_id))
                continue
            if item is None:
                return 0
            if isinstance(item, grpc.RpcError):
                if item.code() == grpc.StatusCode.CANCELLED:
                    return 0
                err.print(f"[red]error[/red] {item.code().name}: {escape(item.details() or '')}")
                return 1
            if bar is not None and item.state not in TRAINING:
                _progress(client, job_id, bar, task)
                bar.stop()
                bar = None
            if waiting is not None and item.state != S.JOB_STATE_QUEUED:
                waiting.stop()
                waiting = None
            show(item)
            if item.state in BAD_END:
                return 1
            if item.state in ORDER and ORDER.index(item.state) >= ORDER.index(target):
                return 0
            if item.state == S.JOB_STATE_QUEUED and waiting is None:
                waiting = console.status("queued")
                waiting.start()
                polled = 0.0  # ask at the next tick
            if item.state in TRAINING and bar is None:
                job = client.jobs.Get(store_pb2.GetRequest(id=job_id))
                bar = Progress(TextColumn("{task.description}"), BarColumn(),
                               TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[detail]}"),
                               console=console, transient=True)
                task = bar.add_task("training", total=job.spec.iterations, detail="")
                bar.start()
    finally:
        if bar is not None:
            bar.stop()
        if waiting is not None:
            waiting.stop()
        stream.cancel()


def queue_line(client: Client, job_id: str) -> str:
    """'queued: position 2 of 5, devices busy, starts in 42 s' from the planner's queue; plain 'queued' if it cannot
    say (the planner has no FleetService, or the job just left the queue)."""
    try:
        entries = client.fleet.ListQueue(services_pb2.ListQueueRequest(), timeout=5).entries
    except grpc.RpcError:
        return "queued"
    mine = next((e for e in entries if e.job_id == job_id), None)
    if mine is None:
        return "queued"
    when = predicted_start(mine.predicted_start_s)
    return (f"queued: position {mine.position} of {len(entries)}, {reason_words(mine.reason)}, "
            + ("start unknown" if when == "unknown" else f"starts {when}"))


def _progress(client: Client, job_id: str, bar: Progress, task) -> None:
    job = client.jobs.Get(store_pb2.GetRequest(id=job_id))
    done = job.iteration + 1 if job.iteration or _any_metric(client, job_id) else 0
    rows = client.store.ListIterationMetrics(store_pb2.ListIterationMetricsRequest(
        job_id=job_id, from_iteration=job.iteration)).metrics
    loss = next((m.loss for m in rows if m.has_loss), None)
    speed = max((m.throughput_samples_per_s for m in rows), default=0.0)
    detail = (f"loss {loss:.4f}  " if loss is not None else "") + (f"{speed:.1f} samples/s" if speed else "")
    bar.update(task, completed=min(done, job.spec.iterations), detail=detail)


def _any_metric(client: Client, job_id: str) -> bool:
    page = client.store.ListIterationMetrics(store_pb2.ListIterationMetricsRequest(job_id=job_id))
    return bool(page.metrics)


def event_line(event: job_pb2.JobEvent) -> str:
    """One event as `watch` prints it (rich markup): seq, state, type, message, and for the shared-fleet
    events the priority class the message leaves out."""
    state = S.Name(event.state).removeprefix("JOB_STATE_")
    colour = COLOURS.get(event.state, "cyan")
    kind = f"{event.type:<16}"
    if event.type in EVENT_COLOURS:
        kind = f"[{EVENT_COLOURS[event.type]}]{kind}[/{EVENT_COLOURS[event.type]}]"
    text = event.message
    cls = event.attributes.get("priority_class", "")
    if event.type in CLASS_EVENTS and cls and f"priority class {cls}" not in text:
        text += f" (priority class {cls})"
    return f"{event.seq:>4} [{colour}]{state:<14}[/{colour}] {kind} {escape(text)}"


def show(event: job_pb2.JobEvent) -> None:
    console.print(event_line(event))
