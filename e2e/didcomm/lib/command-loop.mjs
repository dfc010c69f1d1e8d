// The JSON-line control channel of the Node agents of e2e/didcomm (credo, identus, veramo),
// driven by tests/support/didcomm_stock_agents.py, which copies this directory beside the agent
// it runs.
//
// Commands come one JSON object a line on stdin, each answered on stdout by
// {"id": <same>, "ok": true, ...the handler's result} or {"id", "ok": false, "error"}; a line
// that is not JSON by {"ok": false, "error": "not JSON"}. Commands run concurrently (a send does
// not wait for the one before): the test paces them. {"cmd": "stop"} waits for the commands in
// flight, stops the agent, answers and exits 0 (1 if stopping failed); so does the end of stdin,
// without the answer.
// Events: {"event": "error", "error"} for an unhandled rejection, {"event": "fatal", "error"}
// (then exit 1) when the agent's main fails. A failed command or main is logged on stderr too.

import readline from 'node:readline'

export function emit(obj) {
  process.stdout.write(`${JSON.stringify(obj)}\n`)
}

const describe = (err) => String(err?.stack ?? err)

process.on('unhandledRejection', (err) => {
  emit({ event: 'error', error: describe(err) })
})

// stdout is the control channel: console output (a library's logger) goes to stderr, each line
// stamped with the wall-clock time (to line it up with the relay's log).
export function consoleToStderr() {
  const toStderr = console.error.bind(console)
  const stamped = (...args) => toStderr(new Date().toISOString().slice(11, 23), ...args)
  console.log = stamped
  console.info = stamped
  console.debug = stamped
  console.warn = stamped
  console.error = stamped
}

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
      return shutDown(stop, request)
    }
    const handler = commands[request.cmd]
    if (!handler) {
      emit({ id: request.id, ok: false, error: `unknown command ${request.cmd}` })
      continue
    }
    const run = handler(request)
      .then((result) => emit({ id: request.id, ok: true, ...result }))
      .catch((err) => {
        process.stderr.write(`command ${request.cmd} failed: ${describe(err)}\n`)
        emit({ id: request.id, ok: false, error: describe(err) })
      })
      .finally(() => pending.delete(run))
    pending.add(run)
  }
  return shutDown(stop, null) // stdin closed: the test went away
}

// Stop the agent, answer the stop request (if any) and exit: 0, or 1 when stopping failed.
async function shutDown(stop, request) {
  let failure = null
  try {
    await stop()
  } catch (err) {
    failure = describe(err)
    process.stderr.write(`stop failed: ${failure}\n`)
  }
  if (request) emit(failure ? { id: request.id, ok: false, error: failure } : { id: request.id, ok: true })
  process.exit(failure ? 1 : 0)
}

// Run the agent's `main` (which ends in serveCommands); its failure is a "fatal" event.
export function run(main) {
  main().catch((err) => {
    process.stderr.write(`agent failed: ${describe(err)}\n`)
    emit({ event: 'fatal', error: describe(err) })
    process.exit(1)
  })
}
