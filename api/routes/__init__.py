"""One router per resource: jobs, tickets, and the service's own health and metrics."""
