"""Bad-input fuzzing (issue #12): every gRPC method, the HTTP API, cluster specs and traces."""
