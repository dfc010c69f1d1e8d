// A headless Credo-ts agent for the relayfleet DIDComm e2e test (tests/relay/didcomm/test_didcomm_agents.py).
//
// It is a stock Credo-ts 0.6 agent (Askar wallet in a persistent sqlite store) acting as a
// mediation recipient. The test drives it with JSON lines on stdin and reads JSON lines on
// stdout; Credo's own log goes to stderr.
//
//   node agent.mjs --data DIR --label NAME --strategy PickUpV2|PickUpV2LiveMode [--poll-ms N]
//
// Commands (one JSON object a line, each answered by {"id": <same>, "ok": true, ...} or
// {"id", "ok": false, "error"}; the loop is ../lib/command-loop.mjs, shared with the other agents):
//   {"id", "cmd": "mediate", "url": <mediator OOB invitation URL>}  connect (DID Exchange),
//        request mediation, set it as default mediator, start pickup with --strategy;
//        answers {"connectionId", "routingKeys", "endpoint"}
//   {"id", "cmd": "mediator"}     the default mediator's grant, as for "mediate"
//   {"id", "cmd": "invite"}       an OOB invitation (routed through the mediator): {"url"}
//   {"id", "cmd": "accept", "url"} accept a peer's OOB invitation (our side routed through the
//        mediator); answers once the connection is complete: {"connectionId", "theirLabel"}
//   {"id", "cmd": "hold-acks"}    from the next Pickup 2.0 delivery on, never send anything
//        to the mediator again (so its messages-received never leaves): stands for a crash
//        between receiving and acknowledging; prints {"event": "holding", "count": N}
//   {"id", "cmd": "stop"}         shut the agent down and exit 0
// Events: {"event": "ready"}, {"event": "connection", "state", "theirLabel", "connectionId"},
//   {"event": "basicmessage", "content", "connectionId", "atMs"}, {"event": "holding", ...},
//   {"event": "inbound", "type", "atMs"} for each pickup / coordinate-mediation message received,
//   {"event": "ws-open" | "ws-closed", "connectionId"} for the WebSocket to the mediator
//
// Pickup restarts by itself on start when the wallet already has a default mediator.

// askar-nodejs registers the native Askar library; it must load before @credo-ts/askar.
import { askar } from '@openwallet-foundation/askar-nodejs'
import { AskarModule } from '@credo-ts/askar'
import { Agent, ConsoleLogger, LogLevel } from '@credo-ts/core'
import {
  DidCommBasicMessageEventTypes,
  DidCommBasicMessageRole,
  DidCommConnectionEventTypes,
  DidCommHttpOutboundTransport,
  DidCommMediatorPickupStrategy,
  DidCommModule,
  DidCommTransportEventTypes,
  DidCommWsOutboundTransport,
} from '@credo-ts/didcomm'
import { EventEmitter } from 'node:events'
import { promises as fs } from 'node:fs'
import path from 'node:path'
import { parseArgs } from 'node:util'
import WebSocket from 'ws'
import { consoleToStderr, emit, run, serveCommands } from '../lib/command-loop.mjs'

const DELIVERY_TYPE = 'https://didcomm.org/messagepickup/2.0/delivery'

const { values: opts } = parseArgs({
  options: {
    data: { type: 'string' },
    label: { type: 'string', default: 'relayfleet-e2e-credo' },
    strategy: { type: 'string', default: 'PickUpV2' },
    'poll-ms': { type: 'string', default: '200' },
    'log-level': { type: 'string', default: process.env.CREDO_LOG_LEVEL ?? 'debug' },
  },
})
if (!opts.data) {
  process.stderr.write('--data DIR is required\n')
  process.exit(2)
}
const strategy = DidCommMediatorPickupStrategy[opts.strategy]
if (strategy === undefined) {
  process.stderr.write(`unknown --strategy ${opts.strategy}\n`)
  process.exit(2)
}

// ---- agent dependencies (what @credo-ts/node provides for 0.5; it has no 0.6 release) ----

const dataRoot = path.resolve(opts.data)

class NodeFileSystem {
  constructor() {
    this.dataPath = path.join(dataRoot, 'data')
    this.cachePath = path.join(dataRoot, 'cache')
    this.tempPath = path.join(dataRoot, 'tmp')
  }
  async exists(p) {
    try {
      await fs.access(p)
      return true
    } catch {
      return false
    }
  }
  async createDirectory(p) {
    await fs.mkdir(path.dirname(p), { recursive: true })
  }
  async copyFile(src, dst) {
    await fs.copyFile(src, dst)
  }
  async write(p, data) {
    await fs.mkdir(path.dirname(p), { recursive: true })
    await fs.writeFile(p, data, 'utf-8')
  }
  async read(p) {
    return fs.readFile(p, 'utf-8')
  }
  async delete(p) {
    await fs.rm(p, { recursive: true, force: true })
  }
  async downloadToFile() {
    // Nothing in this agent downloads files (no ledgers, no tails files).
    throw new Error('downloadToFile is not available in the e2e agent')
  }
}

const dependencies = {
  FileSystem: NodeFileSystem,
  EventEmitterClass: EventEmitter,
  fetch: globalThis.fetch,
  WebSocketClass: WebSocket,
}

// ---- outbound transports that can be held (the crash-before-ack case) ----

let holding = false

class HoldableTransport {
  constructor(inner) {
    this.inner = inner
    this.supportedSchemes = inner.supportedSchemes
  }
  async start(agentContext) {
    await this.inner.start(agentContext)
  }
  async stop() {
    await this.inner.stop()
  }
  async sendMessage(outboundPackage) {
    if (holding) {
      // Never settles: the message is neither sent nor failed, as in a process about to die.
      return new Promise(() => {})
    }
    return this.inner.sendMessage(outboundPackage)
  }
}

// ---- the agent ----

const logLevel = LogLevel[opts['log-level']] ?? LogLevel.debug
consoleToStderr() // ConsoleLogger writes to stdout, the control channel

const agent = new Agent({
  config: { logger: new ConsoleLogger(logLevel), allowInsecureHttpUrls: true },
  dependencies,
  modules: {
    askar: new AskarModule({
      askar,
      store: {
        id: 'relayfleet-e2e',
        key: 'relayfleet-e2e-wallet-key',
        database: { type: 'sqlite', config: { path: path.join(dataRoot, 'wallet.sqlite') } },
      },
    }),
    didcomm: new DidCommModule({
      transports: {
        // WebSocket first: Pickup 2.0 live mode asks for a ws(s) service; HTTP for the rest.
        outbound: [
          new HoldableTransport(new DidCommWsOutboundTransport()),
          new HoldableTransport(new DidCommHttpOutboundTransport()),
        ],
      },
      connections: { autoAcceptConnections: true },
      credentials: false,
      proofs: false,
      mediator: false,
      mediationRecipient: {
        mediatorPickupStrategy: strategy,
        mediatorPollingInterval: Number(opts['poll-ms']),
      },
    }),
  },
})

agent.didcomm.registerMessageHandlerMiddleware(async (inboundMessageContext, next) => {
  const type = inboundMessageContext.message.type
  if (type.includes('/messagepickup/') || type.includes('/coordinate-mediation/')) {
    emit({ event: 'inbound', type, atMs: Date.now() })
  }
  if (holdNextDelivery && type === DELIVERY_TYPE) {
    holding = true
    const attachments = inboundMessageContext.message.appendedAttachments ?? []
    emit({ event: 'holding', count: attachments.length })
  }
  await next()
})
let holdNextDelivery = false

agent.events.on(DidCommBasicMessageEventTypes.DidCommBasicMessageStateChanged, (event) => {
  const record = event.payload.basicMessageRecord
  if (record.role !== DidCommBasicMessageRole.Receiver) return
  emit({
    event: 'basicmessage',
    content: event.payload.message.content,
    connectionId: record.connectionId,
    atMs: Date.now(),
  })
})

agent.events.on(DidCommConnectionEventTypes.DidCommConnectionStateChanged, (event) => {
  const record = event.payload.connectionRecord
  emit({
    event: 'connection',
    state: record.state,
    theirLabel: record.theirLabel ?? null,
    connectionId: record.id,
  })
})

agent.events.on(DidCommTransportEventTypes.DidCommOutboundWebSocketOpenedEvent, (event) => {
  emit({ event: 'ws-open', connectionId: event.payload.connectionId ?? null })
})
agent.events.on(DidCommTransportEventTypes.DidCommOutboundWebSocketClosedEvent, (event) => {
  emit({ event: 'ws-closed', connectionId: event.payload.connectionId ?? null })
})

async function grantInfo(mediation) {
  return {
    connectionId: mediation.connectionId,
    mediatorId: mediation.id,
    routingKeys: mediation.routingKeys,
    endpoint: mediation.endpoint ?? null,
    state: mediation.state,
  }
}

const commands = {
  async mediate({ url }) {
    const invitation = await agent.didcomm.oob.parseInvitation(url)
    const routing = await agent.didcomm.mediationRecipient.getRouting({ useDefaultMediator: false })
    const { connectionRecord } = await agent.didcomm.oob.receiveInvitation(invitation, {
      label: opts.label,
      routing,
    })
    if (!connectionRecord) throw new Error('the mediator invitation made no connection')
    const connection = await agent.didcomm.connections.returnWhenIsConnected(connectionRecord.id, {
      timeoutMs: 20000,
    })
    const mediation = await agent.didcomm.mediationRecipient.provision(connection)
    await agent.didcomm.mediationRecipient.initiateMessagePickup(mediation, strategy)
    return grantInfo(mediation)
  },
  async mediator() {
    const mediation = await agent.didcomm.mediationRecipient.findDefaultMediator()
    if (!mediation) throw new Error('no default mediator')
    return grantInfo(mediation)
  },
  async invite() {
    const record = await agent.didcomm.oob.createInvitation({
      label: opts.label,
      multiUseInvitation: false,
      autoAcceptConnection: true,
    })
    return {
      url: record.outOfBandInvitation.toUrl({ domain: 'https://relayfleet.invalid' }),
      outOfBandId: record.id,
    }
  },
  async accept({ url }) {
    // Our side of the new connection is routed through the default mediator (relayfleet).
    const { connectionRecord } = await agent.didcomm.oob.receiveInvitationFromUrl(url, {
      label: opts.label,
      autoAcceptConnection: true,
    })
    if (!connectionRecord) throw new Error('the invitation made no connection')
    const connection = await agent.didcomm.connections.returnWhenIsConnected(connectionRecord.id, {
      timeoutMs: 60000,
    })
    return { connectionId: connection.id, theirLabel: connection.theirLabel ?? null, did: connection.did }
  },
  async 'hold-acks'() {
    holdNextDelivery = true
    return {}
  },
}

run(async () => {
  await agent.initialize()
  emit({ event: 'ready', strategy: opts.strategy })
  await serveCommands(commands, () => agent.shutdown())
})
