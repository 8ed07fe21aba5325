import httpx


async def test_openai_chat_round_trip(proxy) -> None:
    base = await proxy.rollout("ro-1")
    proxy.engines["cell-a"].replies = ["Hello there"]
    proxy.engines["cell-b"].replies = ["Hello there"]
    async with httpx.AsyncClient() as c:
        r = await c.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer k-secret"},
                         json={"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello there"
