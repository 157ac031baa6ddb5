"""deadpool-run: starts active and spare nodes, serves the coordination store, detects failures, and
publishes new rank assignments so spares replace failed nodes without ending the job."""
