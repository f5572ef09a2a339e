"""``tiered daemon status`` as a person reads it: the pool, then each job and its ranks."""
from __future__ import annotations

import time

from ..core.sizes import format_size


def status_table(status: dict) -> str:
    service, dram = status["service"], status["dram"]
    code = service["code"]
    lines = [f"tiered service {service['version']}, pid {service['pid']}, up "
             f"{service['uptime_seconds']:.0f} s, in {service['folder']}"
             + (" (exits once its jobs are gone)" if service.get("until_idle") else ""),
             f"runs the code of {code['installation']} (code {code['code']}); it serves "
             f"launchers and trainers of that code only",
             f"CPU work on {service['usable_cores']} core(s): {_ranges(service['cores'])}"
             + (f", {service['threads_running']} update thread(s) running, at most "
                f"{service['threads_peak']} at once" if "threads_peak" in service else "")
             + (f"; NVMe files under {service['nvme']}" if service.get("nvme") else "")
             + (f"; one I/O queue, {service['io_queue_depth']} deep each way"
                if service.get("io_queue_depth") else ""),
             f"DRAM pool: {format_size(dram['used'])} of {format_size(dram['budget'])} held"
             + (f", {format_size(dram['spare'])} kept spare for the next jobs"
                if dram.get("spare") else "")
             + f"; a failed job's state is kept {status['keep_seconds']:.0f} s"]
    if not status["jobs"]:
        lines.append("no jobs")
    for job in status["jobs"]:
        kept = job["freed_in_seconds"]
        state = job["state"] + (f", freed in {kept:.0f} s" if kept is not None else "")
        world = job["world"] if job["world"] is not None else "?"
        step = (f", last step done {job['last_step']}" if job.get("last_step") else "")
        if job.get("resumable_step"):
            step += ", a relaunch of it goes on from there"
        launcher = job["launcher"]
        held = ("no launcher" if launcher is None else
                f"launcher pid {launcher['pid']} since "
                f"{time.strftime('%H:%M:%S', time.localtime(launcher['since']))}")
        beside = (f" (another engine of job {job['engine_of']}'s processes)"
                  if job.get("engine_of") else "")
        lines.append(f"job {job['name']}{beside}: {state}; world {world}, "
                     f"{len([r for r in job['ranks'] if r['attached']])} ranks attached, "
                     f"{held}{step}")
        for rank in job["ranks"]:
            who = f"pid {rank['pid']}" if rank["attached"] else "gone"
            lines.append(f"  rank {rank['rank']:>3}  {who:<12} DRAM "
                         f"{format_size(rank['dram_bytes'])} in {rank['segments']} segment(s); "
                         f"CPU update in the {rank['host']}"
                         + (f", {rank['threads']} thread(s)" if rank["threads"] else "")
                         + (f", busy {rank['busy']:.0%} since it started"
                            if rank.get("busy") is not None else ""))
            if rank.get("nvme_bytes") is not None:
                lines.append(f"{'':<20}NVMe {format_size(rank['nvme_bytes'])} in "
                             f"{rank['folder']}; I/O queue: {rank['io_in_flight']} in flight, "
                             f"{format_size(rank['read_bytes'])} read, "
                             f"{format_size(rank['written_bytes'])} written")
    return "\n".join(lines)


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] as "0-2,5"."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
