// The official OpenAI and Anthropic SDKs against a running `dsx serve` (tests/sdk/run.sh
// starts one on the tiny model): chat completions, responses and messages, streaming and
// not, usage with cached prompt tokens on a second turn, and the error shapes the SDKs
// turn into typed errors. Exits 1 on the first failed check.
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

const base = process.env.DSX_URL ?? "http://127.0.0.1:8080";
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: "dummy", maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: base, apiKey: "dummy", maxRetries: 0 });
let failures = 0;
function check(cond, what) {
  if (cond) {
    console.log(`ok   ${what}`);
  } else {
    console.log(`FAIL ${what}`);
    failures++;
  }
}
async function step(name, fn) {
  try {
    await fn();
  } catch (e) {
    console.log(`FAIL ${name}: ${e?.constructor?.name} ${e?.status ?? ""} ${e?.message}`);
    failures++;
  }
}

const system = "You are a coding agent. ".repeat(200);
const tools = [{ type: "function", function: { name: "bash", description: "Run a command",
  parameters: { type: "object", properties: { command: { type: "string" } }, required: ["command"] } } }];

await step("chat completions", async () => {
  const r = await openai.chat.completions.create({ model: "dsx-any", max_tokens: 8, temperature: 0,
    messages: [{ role: "system", content: system }, { role: "user", content: "Say hi." }], tools });
  check(r.object === "chat.completion", "chat: object");
  check(typeof r.choices[0].finish_reason === "string", `chat: finish_reason ${r.choices[0].finish_reason}`);
  check(r.usage.prompt_tokens > 200, `chat: usage.prompt_tokens ${r.usage.prompt_tokens}`);
  const s = await openai.chat.completions.create({ model: "dsx-any", max_tokens: 8, temperature: 0, stream: true,
    stream_options: { include_usage: true },
    messages: [{ role: "system", content: system }, { role: "user", content: "Say hi again." }], tools });
  let finish = null, usage = null, role = null;
  for await (const ch of s) {
    if (ch.choices?.[0]?.delta?.role) role = ch.choices[0].delta.role;
    if (ch.choices?.[0]?.finish_reason) finish = ch.choices[0].finish_reason;
    if (ch.usage) usage = ch.usage;
  }
  check(role === "assistant", "chat stream: role");
  check(finish !== null, `chat stream: finish_reason ${finish}`);
  check(usage && usage.prompt_tokens_details?.cached_tokens >= usage.prompt_tokens * 0.9,
    `chat stream: second turn cached ${usage?.prompt_tokens_details?.cached_tokens} of ${usage?.prompt_tokens}`);
});

await step("responses", async () => {
  const r = await openai.responses.create({ model: "dsx-any", max_output_tokens: 8, store: false,
    input: [{ type: "message", role: "developer", content: [{ type: "input_text", text: "You code." }] },
            { type: "message", role: "user", content: [{ type: "input_text", text: "Say hi." }] }] });
  check(r.object === "response", "responses: object");
  check(["completed", "incomplete"].includes(r.status), `responses: status ${r.status}`);
  check(Array.isArray(r.output), "responses: output");
  const s = await openai.responses.create({ model: "dsx-any", max_output_tokens: 8, store: false, stream: true,
    input: "Say hi." });
  let done = 0, terminal = null;
  for await (const ev of s) {
    if (ev.type === "response.output_item.done") done++;
    if (ev.type === "response.completed" || ev.type === "response.incomplete") terminal = ev;
  }
  check(done >= 1, `responses stream: ${done} output_item.done`);
  check(terminal && terminal.response.usage, `responses stream: ${terminal?.type} with usage`);
});

await step("messages", async () => {
  const r = await anthropic.messages.create({ model: "claude-any", max_tokens: 8,
    system: [{ type: "text", text: "Be brief." }], messages: [{ role: "user", content: "Say hi." }] });
  check(r.type === "message", "messages: type");
  check(typeof r.stop_reason === "string", `messages: stop_reason ${r.stop_reason}`);
  check(r.usage.input_tokens + (r.usage.cache_read_input_tokens ?? 0) > 0, "messages: usage");
  const stream = anthropic.messages.stream({ model: "claude-any", max_tokens: 8,
    messages: [{ role: "user", content: "Say hi." }], thinking: { type: "adaptive" } });
  const m = await stream.finalMessage();
  check(typeof m.stop_reason === "string", `messages stream: stop_reason ${m.stop_reason}`);
  const n = await anthropic.messages.countTokens({ model: "claude-any", messages: [{ role: "user", content: "Say hi." }] });
  check(n.input_tokens > 0, `count_tokens: ${n.input_tokens}`);
});

await step("forced tool calls", async () => {
  const r = await openai.chat.completions.create({ model: "dsx-any", max_tokens: 200, temperature: 0,
    messages: [{ role: "user", content: "List the files." }], tools,
    tool_choice: { type: "function", function: { name: "bash" } } });
  const call = r.choices[0].message.tool_calls?.[0];
  check(r.choices[0].finish_reason === "tool_calls", `chat forced call: finish ${r.choices[0].finish_reason}`);
  let args = null;
  try { args = JSON.parse(call?.function?.arguments ?? ""); } catch {}
  check(call?.function?.name === "bash" && typeof args?.command === "string",
    `chat forced call: ${call?.function?.name} ${call?.function?.arguments?.slice(0, 60)}`);
  const m = await anthropic.messages.create({ model: "claude-any", max_tokens: 200,
    messages: [{ role: "user", content: "Read it." }], tool_choice: { type: "any" },
    tools: [{ name: "read", description: "Read a file",
      input_schema: { type: "object", properties: { path: { type: "string" } }, required: ["path"] } }] });
  const use = m.content.find((b) => b.type === "tool_use");
  check(m.stop_reason === "tool_use" && use?.name === "read" && typeof use?.input?.path === "string",
    `messages forced call: ${m.stop_reason} ${use?.name}`);
});

await step("errors", async () => {
  try {
    await openai.chat.completions.create({ model: "x", messages: [{ role: "nobody", content: "?" }] });
    check(false, "chat: a bad role is refused");
  } catch (e) {
    check(e.status === 400 && e.error?.type === "invalid_request_error", `chat error: ${e.status} ${e.error?.type}`);
  }
  try {
    await anthropic.messages.create({ model: "x", messages: [{ role: "user", content: "hi" }] });
    check(false, "messages: missing max_tokens is refused");
  } catch (e) {
    check(e.status === 400 && e.error?.error?.type === "invalid_request_error", `messages error: ${e.status} ${e.error?.error?.type}`);
  }
});

console.log(failures ? `${failures} failed` : "all passed");
process.exit(failures ? 1 : 0);
