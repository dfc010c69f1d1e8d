// A headless Hyperledger Identus SDK 7.0.0 agent for relayfleet's DIDComm v2 tests
// (tests/relay/didcomm_v2/, tests/support/didcomm_stock_agents.py).
//
// A stock Identus Agent (Apollo, Castor, Mercury, Pluto from the SDK) over a small in-memory
// store: the SDK ships no store, only its Pluto.Store interface (query/insert/update/delete with
// Mango selectors). The test drives it with JSON lines on stdin and reads JSON lines on stdout;
// the SDK's own log goes to stderr.
//
//   node [--experimental-websocket] agent.mjs [--mediator-did DID] [--live] [--poll-ms N]
//
// With --mediator-did the agent asks that mediator for mediation at start (Coordinate Mediation
// 2.0) and picks up with Pickup 3.0: polling every --poll-ms, or with --live over the WebSocket
// the mediator's DID names (Node 20 needs --experimental-websocket for the global WebSocket).
// Without it the agent only sends.
//
// Commands (one JSON object a line, each answered by {"id": <same>, "ok": true, ...} or
// {"id", "ok": false, "error"}; the loop is ../lib/command-loop.mjs, shared with the other agents):
//   {"id", "cmd": "new-did"}   a new peer DID; when mediated, registered with the mediator
//                              (keylist-update) and routed through it: {"did"}
//   {"id", "cmd": "send", "from", "to", "content"}  a basic message (2.0) from one of our DIDs:
//                              answers once the SDK's POST returned: {"msgId", "t0Ms", "t1Ms"}
//   {"id", "cmd": "mediator"}  {"state", "mediatorDid", "hostDid", "routingDid", "live"}
//   {"id", "cmd": "stop"}      stop the agent and exit 0
// Events: {"event": "ready", "mediation": <state name>|null},
//   {"event": "messages", "atMs", "items": [{"msgId", "piuri", "from", "to", "content"}]} for each
//   batch the SDK hands its MESSAGE listeners (a Pickup delivery, after its messages-received
//   was answered), {"event": "http", "method", "status", "t0Ms", "t1Ms"} for each request of
//   the SDK's HTTP client (status 0: no answer), {"event": "error", "error"} for an
//   unhandled rejection.

import SDK from '@hyperledger/identus-sdk'
import { parseArgs } from 'node:util'
import { consoleToStderr, emit, run, serveCommands } from '../lib/command-loop.mjs'

const { values: opts } = parseArgs({
  options: {
    'mediator-did': { type: 'string' },
    live: { type: 'boolean', default: false },
    'poll-ms': { type: 'string', default: '500' },
  },
})

consoleToStderr() // the SDK logs with console.*

// ---- Pluto.Store in memory ----
// Selectors the SDK's repositories use: field equality, $and, $or (an empty $or matches
// nothing), and the few operators below; anything else is refused loudly rather than guessed.

function matches(row, selector) {
  if (!selector) return true
  for (const [key, want] of Object.entries(selector)) {
    if (key === '$and') {
      if (!want.every((s) => matches(row, s))) return false
    } else if (key === '$or') {
      if (!want.some((s) => matches(row, s))) return false
    } else if (key === '$nor') {
      if (want.some((s) => matches(row, s))) return false
    } else if (want !== null && typeof want === 'object' && !Array.isArray(want)) {
      if (!operators(row[key], want)) return false
    } else if (row[key] !== want) {
      return false
    }
  }
  return true
}

function operators(value, ops) {
  for (const [op, arg] of Object.entries(ops)) {
    switch (op) {
      case '$eq':
        if (value !== arg) return false
        break
      case '$ne':
        if (value === arg) return false
        break
      case '$in':
        if (!arg.includes(value)) return false
        break
      case '$nin':
        if (arg.includes(value)) return false
        break
      case '$exists':
        if ((value !== undefined) !== arg) return false
        break
      default:
        throw new Error(`in-memory store: query operator ${op} not implemented`)
    }
  }
  return true
}

class MemoryStore {
  constructor() {
    this.tables = new Map()
  }
  table(name) {
    if (!this.tables.has(name)) this.tables.set(name, new Map())
    return this.tables.get(name)
  }
  async query(name, query) {
    let rows = [...this.table(name).values()].filter((row) => matches(row, query?.selector))
    if (query?.skip) rows = rows.slice(query.skip)
    if (query?.limit !== undefined) rows = rows.slice(0, query.limit)
    return rows.map((row) => structuredClone(row))
  }
  async insert(name, model) {
    const rows = this.table(name)
    if (rows.has(model.uuid)) throw new Error(`in-memory store: ${name} ${model.uuid} exists`)
    rows.set(model.uuid, structuredClone(model))
  }
  async update(name, model) {
    const rows = this.table(name)
    if (!rows.has(model.uuid)) throw new Error(`in-memory store: ${name} ${model.uuid} not found`)
    rows.set(model.uuid, structuredClone(model))
  }
  async delete(name, uuid) {
    if (!this.table(name).delete(uuid)) throw new Error(`in-memory store: ${name} ${uuid} not found`)
  }
}

// ---- the SDK's HTTP client, timed (Agent.initialize takes an `api`) ----

class TimedApi extends SDK.ApiImpl {
  async request(method, url, urlParams, headers, body) {
    const t0Ms = Date.now()
    try {
      const response = await super.request(method, url, urlParams, headers, body)
      emit({ event: 'http', method, status: response.httpStatus, t0Ms, t1Ms: Date.now() })
      return response
    } catch (err) {
      emit({ event: 'http', method, status: err?.status ?? 0, t0Ms, t1Ms: Date.now(), error: String(err) })
      throw err
    }
  }
}

// ---- the agent ----

const apollo = new SDK.Apollo()
const pluto = new SDK.Pluto(new MemoryStore(), apollo)
const agent = SDK.Agent.initialize({
  pluto,
  apollo,
  api: new TimedApi(),
  mediatorDID: opts['mediator-did'],
  options: { experiments: { liveMode: opts.live } },
})

// The SDK drops a message it cannot open without a word (DIDCommConnection.receive returns
// undefined): say so in the log, which the test prints on failure. (It also tries to open
// every empty 202 answer, as the JSON text '""': not worth a line.)
const unpack = agent.mercury.unpackMessage.bind(agent.mercury)
agent.mercury.unpackMessage = async (raw) => {
  try {
    return await unpack(raw)
  } catch (err) {
    if (raw === '""' || raw === '') throw err
    console.error('unpack failed:', String(err?.stack ?? err), String(raw).slice(0, 4000))
    throw err
  }
}

const STATE_NAMES = ['UNKNOWN', 'NEW', 'REQUESTED', 'DENIED', 'GRANTED', 'CLOSED', 'BROKEN']

function mediatorInfo() {
  const m = agent.connections.mediator
  if (!m) return { state: null }
  return {
    state: STATE_NAMES[m.state] ?? String(m.state),
    mediatorDid: m.uri,
    hostDid: m.host,
    routingDid: m.routingDID ?? null,
    live: Boolean(m.liveMode),
  }
}

function bodyContent(body) {
  if (typeof body === 'string') {
    try {
      return JSON.parse(body).content
    } catch {
      return undefined
    }
  }
  return body?.content
}

agent.addListener(SDK.ListenerKey.MESSAGE, (messages) => {
  emit({
    event: 'messages',
    atMs: Date.now(),
    items: messages.map((m) => ({
      msgId: m.id,
      piuri: m.piuri,
      from: m.from?.toString(),
      to: m.to?.toString(),
      content: bodyContent(m.body),
    })),
  })
})

const commands = {
  async 'new-did'() {
    const mediated = Boolean(agent.connections.mediator)
    const did = await agent.createNewPeerDID([], mediated)
    return { did: did.toString() }
  },
  async send({ from, to, content }) {
    const message = new SDK.BasicMessage(
      { content },
      SDK.Domain.DID.fromString(from),
      SDK.Domain.DID.fromString(to),
    ).makeMessage()
    const t0Ms = Date.now()
    await agent.sendMessage(message)
    return { msgId: message.id, t0Ms, t1Ms: Date.now() }
  },
  async mediator() {
    return mediatorInfo()
  },
}

run(async () => {
  await agent.start()
  if (agent.connections.mediator && !opts.live) {
    // Agent.start polls every 5 s; the tests choose the period.
    agent.stopFetchingMessages()
    await agent.startFetchingMessages(Number(opts['poll-ms']))
  }
  emit({ event: 'ready', mediation: mediatorInfo().state })
  await serveCommands(commands, () => agent.stop())
})
