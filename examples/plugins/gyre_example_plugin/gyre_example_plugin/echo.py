"""The example harness: one chat completion with the task text, through the proxy."""

import os
import sys

import httpx

prompt_file, model = sys.argv[1], sys.argv[2]
r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
               headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
               json={"model": model, "messages": [{"role": "user", "content": open(prompt_file).read()}]},
               timeout=600)
print(r.status_code)
sys.exit(0 if r.status_code == 200 else 1)
