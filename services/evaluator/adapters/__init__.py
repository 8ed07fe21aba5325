"""The evaluator's edges: snapshot unpacking, the sandbox, the judge client, the task catalog."""
