// A stock Credo-ts 0.5 agent with @credo-ts/push-notifications 0.7.1 (the newest release of the
// module; it needs Credo 0.5, so it cannot share the 0.6 agent of ../credo): it connects to the
// relayfleet mediator and sets and reads its device info over push-notifications-fcm 1.0 and
// push-notifications-apns 1.0 through the module's own API. Driven by
// tests/relay/didcomm/test_didcomm_push_agents.py:
//
//   node agent.mjs --data DIR --url <mediator OOB invitation URL> --fcm-token T --apns-token T
//
// Prints one JSON line per step to stdout ({"step", "type", "body"}: each message the mediator
// answered, as Credo received it), then {"done": true}; Credo's log goes to stderr.

// aries-askar-nodejs registers the native Askar library (LIB_ARIES_ASKAR_PATH); first.
import '@hyperledger/aries-askar-nodejs'
import { ariesAskar } from '@hyperledger/aries-askar-nodejs'
import { AskarModule } from '@credo-ts/askar'
import {
  Agent,
  AgentEventTypes,
  ConnectionsModule,
  ConsoleLogger,
  DidExchangeState,
  HttpOutboundTransport,
  LogLevel,
} from '@credo-ts/core'
import { agentDependencies } from '@credo-ts/node'
import { PushNotificationsApnsModule, PushNotificationsFcmModule } from '@credo-ts/push-notifications'
import path from 'node:path'
import { parseArgs } from 'node:util'

const { values: opts } = parseArgs({
  options: {
    data: { type: 'string' },
    url: { type: 'string' },
    'fcm-token': { type: 'string' },
    'apns-token': { type: 'string' },
    'log-level': { type: 'string', default: process.env.CREDO_LOG_LEVEL ?? 'info' },
  },
})
const emit = (obj) => process.stdout.write(`${JSON.stringify(obj)}\n`)
// stdout is the test's channel: Credo's console logger goes to stderr
const toStderr = console.error.bind(console)
for (const name of ['log', 'info', 'debug', 'warn']) console[name] = toStderr

const agent = new Agent({
  config: {
    label: 'relayfleet-credo-push',
    walletConfig: {
      id: 'relayfleet-credo-push',
      key: 'relayfleet-credo-push-key',
      storage: { type: 'sqlite', config: { path: path.join(path.resolve(opts.data), 'wallet.sqlite') } },
    },
    logger: new ConsoleLogger(LogLevel[opts['log-level']] ?? LogLevel.info),
    allowInsecureHttpUrls: true,
  },
  dependencies: agentDependencies,
  modules: {
    askar: new AskarModule({ ariesAskar }),
    connections: new ConnectionsModule({ autoAcceptConnections: true }),
    pushNotificationsFcm: new PushNotificationsFcmModule(),
    pushNotificationsApns: new PushNotificationsApnsModule(),
  },
})
agent.registerOutboundTransport(new HttpOutboundTransport())

// Every message Credo processed from the mediator, by thread: the answers to our requests.
const processed = new Map()
const waiters = new Map()
agent.events.on(AgentEventTypes.AgentMessageProcessed, ({ payload }) => {
  const m = payload.message
  const thid = m.threadId
  const seen = { type: m.type, body: m.toJSON() }
  processed.set(thid, seen)
  waiters.get(thid)?.(seen)
})
function answerTo(id, ms = 20000) {
  if (processed.has(id)) return Promise.resolve(processed.get(id))
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no answer to ${id} within ${ms} ms`)), ms)
    waiters.set(id, (seen) => {
      clearTimeout(timer)
      resolve(seen)
    })
  })
}
// The module's API sends and returns nothing: the id of what it sent is read from the outbound
// event, the module's own messages only (Credo sends its DID Exchange complete meanwhile).
let lastSent = null
agent.events.on('AgentMessageSent', ({ payload }) => {
  const sent = payload.message.message
  if (sent.type.includes('/push-notifications-')) lastSent = sent.id
})

async function step(name, send) {
  lastSent = null
  await send()
  const seen = await answerTo(lastSent)
  emit({ step: name, sent: lastSent, type: seen.type, body: seen.body })
}

try {
  await agent.initialize()
  const { connectionRecord } = await agent.oob.receiveInvitationFromUrl(opts.url, { label: 'relayfleet-credo-push' })
  const conn = await agent.connections.returnWhenIsConnected(connectionRecord.id, { timeoutMs: 30000 })
  if (conn.state !== DidExchangeState.Completed) throw new Error(`connection ${conn.state}`)
  emit({ step: 'connected', type: 'connection', body: { state: conn.state } })
  const fcm = agent.modules.pushNotificationsFcm
  const apns = agent.modules.pushNotificationsApns
  await step('fcm-get-before', () => fcm.getDeviceInfo(conn.id))
  await step('fcm-set', () =>
    fcm.setDeviceInfo(conn.id, { deviceToken: opts['fcm-token'], devicePlatform: 'android' }),
  )
  await step('fcm-get', () => fcm.getDeviceInfo(conn.id))
  await step('apns-set', () => apns.setDeviceInfo(conn.id, { deviceToken: opts['apns-token'] }))
  await step('apns-get', () => apns.getDeviceInfo(conn.id))
  await step('fcm-unset', () => fcm.setDeviceInfo(conn.id, { deviceToken: null, devicePlatform: null }))
  await step('fcm-get-after', () => fcm.getDeviceInfo(conn.id))
  emit({ done: true })
  await agent.shutdown()
  process.exit(0)
} catch (err) {
  emit({ error: String(err?.stack ?? err) })
  process.exit(1)
}
