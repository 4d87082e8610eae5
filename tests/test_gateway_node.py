"""`agentkv gateway` under Node's official `openai` package, run by `node`: JSON, streaming, text completions, a 401.

The package is installed with npm into ``$AGENTKV_CACHE_DIR/node-openai`` when it is not there yet. Without node
or npm the test skips, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from agentkv._support.env import cache_dir
from agentkv.gateway import GatewayConfig, GatewayThread
from conftest import chat_requests
from gateway_helpers import ACME, config_fields

OPENAI_NPM = "openai@5"

SCRIPT = r"""
const { OpenAI } = require("openai");
const base = process.env.GW_BASE, key = process.env.GW_KEY, tag = process.env.GW_TAG;
async function main() {
  const client = new OpenAI({ baseURL: base, apiKey: key, maxRetries: 0 });
  const out = {};
  const messages = [{ role: "user", content: `node ${tag}` }];
  const { data, response } = await client.chat.completions.create(
    { model: "agentkv", messages, max_tokens: 4 }).withResponse();
  out.json = { model: data.model, backend: response.headers.get("x-agentkv-backend"),
               route: response.headers.get("x-agentkv-route") };
  const stream = await client.chat.completions.create({ model: "agentkv", messages, max_tokens: 6, stream: true });
  const models = new Set(); let chunks = 0;
  for await (const chunk of stream) { chunks += 1; models.add(chunk.model); }
  out.stream = { chunks, models: [...models] };
  const text = await client.completions.create({ model: "agentkv", prompt: `node ${tag}`, max_tokens: 3 });
  out.completion = { model: text.model, object: text.object };
  const listed = await client.models.list();
  out.models = listed.data.map((m) => m.id);
  try {
    await new OpenAI({ baseURL: base, apiKey: "sk-wrong", maxRetries: 0 }).chat.completions.create(
      { model: "agentkv", messages, max_tokens: 2 });
    out.unauthorized = null;
  } catch (err) {
    out.unauthorized = { status: err.status, name: err.constructor.name };
  }
  console.log(JSON.stringify(out));
}
main().catch((err) => { console.error(err); process.exit(1); });
"""


def _unavailable(reason):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI needs node and npm for the Node SDK test: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def node_openai():
    """The node binary and a node_modules folder holding the `openai` package (installed with npm if absent)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        _unavailable("node or npm is not installed")
    folder = cache_dir() / "node-openai"
    if not (folder / "node_modules" / "openai" / "package.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(folder), OPENAI_NPM],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            _unavailable(f"npm install {OPENAI_NPM} failed: {done.stderr[-500:]}")
    return node, folder / "node_modules"


def test_the_node_openai_sdk_through_the_gateway(node_openai, fresh, tmp_path):
    """Node's `openai`: a JSON answer with route headers, a stream, a text completion, /models and a 401."""
    node, modules = node_openai
    with GatewayThread(GatewayConfig(**config_fields(fresh, tmp_path))) as gateway:
        script = tmp_path / "client.js"
        script.write_text(SCRIPT)
        env = {**os.environ, "NODE_PATH": str(modules), "GW_BASE": gateway.base_url, "GW_KEY": ACME,
               "GW_TAG": str(uuid.uuid4())}
        done = subprocess.run([node, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    fast = fresh["fast"].model_id
    assert out["json"] == {"model": fast, "backend": "fast", "route": "fits"}
    assert out["stream"]["chunks"] > 1 and out["stream"]["models"] == [fast]
    assert out["completion"] == {"model": fast, "object": "text_completion"}
    assert out["models"] == ["agentkv"]
    assert out["unauthorized"] == {"status": 401, "name": "AuthenticationError"}
    assert len(chat_requests(fresh["fast"])) == 2
