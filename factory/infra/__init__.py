"""Low-level process and HTTP utilities that the core and the environments build on: supervised service
processes and the one retry helper (supervisor), request guards for the HTTP services (http_guard), fault
injection points for tests (faults), and CPU/GPU placement of processes and threads (placement)."""
