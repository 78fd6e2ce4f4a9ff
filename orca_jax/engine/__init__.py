"""The iteration-level engine: requests, KV pages, scheduler, runner, step loop."""
