"""The evaluator's pure core: specs, result parsing, scoring, judge prompts and replies."""
