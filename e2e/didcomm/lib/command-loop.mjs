// The JSON-line control channel of the DIDComm v2 agents (e2e/didcomm/identus/agent.mjs,
// e2e/didcomm/veramo/agent.mjs), driven by tests/support/didcomm_stock_agents.py, which copies
// this directory beside the agent it runs.
//
// Commands come one JSON object a line on stdin, each answered on stdout by
// {"id": <same>, "ok": true, ...the handler's result} or {"id", "ok": false, "error"}; a line
// that is not JSON by {"ok": false, "error": "not JSON"}. Commands run concurrently (a send does
// not wait for the one before): the test paces them. {"cmd": "stop"} waits for the commands in
// flight, stops the agent, answers and exits 0; so does the end of stdin, without the answer.
// Events: {"event": "error", "error"} for an unhandled rejection, {"event": "fatal", "error"}
// (then exit 1) when the agent's main fails.

import readline from 'node:readline'

export function emit(obj) {
  process.stdout.write(`${JSON.stringify(obj)}\n`)
}

process.on('unhandledRejection', (err) => {
  emit({ event: 'error', error: String(err?.stack ?? err) })
})

const describe = (err) => String(err?.stack ?? err)

// Answer the commands of stdin with `commands[cmd](request)` until "stop" or the end of stdin;
// `stop` shuts the agent down before the process exits.
export async function serveCommands(commands, stop = async () => {}) {
  const pending = new Set()
  const lines = readline.createInterface({ input: process.stdin })
  for await (const line of lines) {
    if (!line.trim()) continue
    let request
    try {
      request = JSON.parse(line)
    } catch {
      emit({ ok: false, error: 'not JSON' })
      continue
    }
    if (request.cmd === 'stop') {
      await Promise.allSettled(pending)
      await stop()
      emit({ id: request.id, ok: true })
      process.exit(0)
    }
    const handler = commands[request.cmd]
    if (!handler) {
      emit({ id: request.id, ok: false, error: `unknown command ${request.cmd}` })
      continue
    }
    const run = handler(request)
      .then((result) => emit({ id: request.id, ok: true, ...result }))
      .catch((err) => emit({ id: request.id, ok: false, error: describe(err) }))
      .finally(() => pending.delete(run))
    pending.add(run)
  }
  await stop()
  process.exit(0)
}

// Run the agent's `main` (which ends in serveCommands); its failure is a "fatal" event.
export function run(main) {
  main().catch((err) => {
    emit({ event: 'fatal', error: describe(err) })
    process.exit(1)
  })
}
