"""`coderai up` as an app: `plan` (what to start, from the arguments and the data dir), `datadir` (what the data dir
holds, made once), `servers` (nats-server, redis-server, a head's sentinel, kept up), `children` (the services under
the supervisor), `ready` (readiness and the banner), `local` (how the CLI reaches a running stack) and `main`, the
sequence of those steps. A head of several runs the same steps: `heads` (what a head keeps about the others, the
invite), `ha` (its place among them once its NATS is up), `invite` (`coderai heads invite`).

Nothing is imported here: `coderai.heads` (read by the gateway and the scheduler) imports `stack.heads` and
`stack.ha` without the rest of `coderai up`.
"""
