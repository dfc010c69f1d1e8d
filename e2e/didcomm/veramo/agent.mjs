// A headless Veramo 7.0.1 agent with @veramo/did-comm for relayfleet's DIDComm v2 tests
// (tests/relay/didcomm_v2/, tests/support/didcomm_stock_agents.py).
//
// Stock Veramo plugins, all in memory: key manager (kms-local), DID manager with the did:peer
// provider (num_algo 2), the did:peer resolver, the DIDComm plugin with its HTTP transport, and
// the message handler chain DIDComm -> Coordinate Mediation 3.0 recipient -> Pickup 3.0
// recipient -> a last handler that records basic messages. Veramo has no pickup loop of its own:
// the test asks for each delivery (`poll`), which gives it exact request times.
//
//   node agent.mjs [--mediator-did DID]
//
// Commands (one JSON object a line, each answered by {"id": <same>, "ok": true, ...} or
// {"id", "ok": false, "error"}; the loop is ../lib/command-loop.mjs, shared with the other agents):
//   {"id", "cmd": "mediate"}   a host did:peer:2 and a 3.0 mediate-request from it (packed
//        authcrypt, built by createV3MediateRequestMessage): {"state": "granted"|<reply type>,
//        "hostDid", "routingDid"}; the grant is handled by Veramo's own 3.0 recipient handler
//   {"id", "cmd": "new-did"}   a did:peer:2 whose DIDCommMessaging service names the routing DID
//        (the service Veramo's grant handler would add), registered with a 3.0 recipient-update:
//        {"did", "replyType", "body"} (the recipient-update-response's); before mediation, a
//        did:peer:2 without a service (a sender's): {"did"}
//   {"id", "cmd": "send", "from", "to", "content", "packing"?}  a basic message (2.0) packed
//        authcrypt (or "anoncrypt") and sent with sendDIDCommMessage (which wraps the forward):
//        {"msgId", "t0Ms", "t1Ms"}
//   {"id", "cmd": "poll", "limit"}  one Pickup 3.0 delivery-request; Veramo's recipient handler
//        unpacks the delivery and answers messages-received itself: {"t0Ms", "t1Ms", "replyType",
//        "items": [{"attachmentId", "msgId", "content"}]} in the delivery's order
//   {"id", "cmd": "status"}    a Pickup 3.0 status-request: {"replyType", "body"}
//   {"id", "cmd": "stop"}      exit 0
// Events: {"event": "ready"}, {"event": "error", "error"} for an unhandled rejection.

import { createAgent } from '@veramo/core'
import { DataStoreJson } from '@veramo/data-store-json'
import {
  CoordinateMediationV3RecipientMessageHandler,
  createV3DeliveryRequestMessage,
  createV3MediateRequestMessage,
  createV3RecipientUpdateMessage,
  createV3StatusRequestMessage,
  DIDComm,
  DIDCommHttpTransport,
  DIDCommMessageHandler,
  PickupRecipientMessageHandler,
  UpdateAction,
} from '@veramo/did-comm'
import { DIDManager, MemoryDIDStore } from '@veramo/did-manager'
import { getResolver as peerResolver, PeerDIDProvider } from '@veramo/did-provider-peer'
import { DIDResolverPlugin } from '@veramo/did-resolver'
import { KeyManager, MemoryKeyStore, MemoryPrivateKeyStore } from '@veramo/key-manager'
import { KeyManagementSystem } from '@veramo/kms-local'
import { AbstractMessageHandler, MessageHandler } from '@veramo/message-handler'
import { Resolver } from 'did-resolver'
import { parseArgs } from 'node:util'
import { randomUUID } from 'node:crypto'
import { emit, run, serveCommands } from '../lib/command-loop.mjs'

const BASIC_MESSAGE = 'https://didcomm.org/basicmessage/2.0/message'
const MEDIATE_GRANT = 'https://didcomm.org/coordinate-mediation/3.0/mediate-grant'
const DELIVERY = 'https://didcomm.org/messagepickup/3.0/delivery'

const { values: opts } = parseArgs({ options: { 'mediator-did': { type: 'string' } } })

// Basic messages unpacked from deliveries, by the mediator's attachment id.
const received = new Map()

class BasicMessageRecorder extends AbstractMessageHandler {
  async handle(message, context) {
    if (message.type === BASIC_MESSAGE) {
      const fromMediator = (message.metaData ?? []).find((m) => m.type === 'didCommMsgFromMediator')
      received.set(fromMediator?.value ?? message.id, { msgId: message.id, content: message.data?.content })
      return message
    }
    return super.handle(message, context)
  }
}

const store = { notifyUpdate: async () => {} }
const agent = createAgent({
  plugins: [
    new KeyManager({
      store: new MemoryKeyStore(),
      kms: { local: new KeyManagementSystem(new MemoryPrivateKeyStore()) },
    }),
    new DIDManager({
      store: new MemoryDIDStore(),
      defaultProvider: 'did:peer',
      providers: { 'did:peer': new PeerDIDProvider({ defaultKms: 'local' }) },
    }),
    new DIDResolverPlugin({ resolver: new Resolver({ ...peerResolver() }) }),
    new DataStoreJson(store),
    new DIDComm({ transports: [new DIDCommHttpTransport()] }),
    new MessageHandler({
      messageHandlers: [
        new DIDCommMessageHandler(),
        new CoordinateMediationV3RecipientMessageHandler(),
        new PickupRecipientMessageHandler(),
        new BasicMessageRecorder(),
      ],
    }),
  ],
})

const mediatorDid = opts['mediator-did']
const mediation = { hostDid: null, routingDid: null }

async function newPeerDid(service) {
  const identifier = await agent.didManagerCreate({
    provider: 'did:peer',
    options: { num_algo: 2, ...(service ? { service } : {}) },
  })
  return identifier.did
}

// Pack authcrypt and send; the mediator's return-routed answer comes back handled.
async function exchange(message) {
  const packed = await agent.packDIDCommMessage({ message, packing: 'authcrypt' })
  const result = await agent.sendDIDCommMessage({
    packedMessage: packed,
    recipientDidUrl: message.to[0],
    messageId: message.id,
  })
  return result?.returnMessage
}

function needMediator() {
  if (!mediatorDid) throw new Error('started without --mediator-did')
  if (!mediation.hostDid) throw new Error('not mediated yet (mediate first)')
}

const commands = {
  async mediate() {
    if (!mediatorDid) throw new Error('started without --mediator-did')
    const hostDid = await newPeerDid()
    const request = createV3MediateRequestMessage(hostDid, mediatorDid)
    // Veramo's grant handler looks the request up by the grant's thid.
    await agent.dataStoreSaveMessage({
      message: { id: request.id, type: request.type, from: hostDid, to: mediatorDid, createdAt: request.created_time },
    })
    const reply = await exchange(request)
    if (reply?.type !== MEDIATE_GRANT) {
      return { state: reply?.type ?? null, hostDid, data: reply?.data ?? null }
    }
    mediation.hostDid = hostDid
    mediation.routingDid = reply.data.routing_did[0]
    return { state: 'granted', hostDid, routingDid: mediation.routingDid, data: reply.data }
  },
  async 'new-did'() {
    if (!mediation.hostDid) return { did: await newPeerDid() } // a sender's DID: no service
    const did = await newPeerDid({
      type: 'DIDCommMessaging',
      serviceEndpoint: { uri: mediation.routingDid, accept: ['didcomm/v2'] },
    })
    const update = createV3RecipientUpdateMessage(mediation.hostDid, mediatorDid, [
      { recipient_did: did, action: UpdateAction.ADD },
    ])
    const reply = await exchange(update)
    return { did, replyType: reply?.type ?? null, body: reply?.data ?? null }
  },
  async send({ from, to, content, packing }) {
    const message = {
      type: BASIC_MESSAGE,
      id: randomUUID(),
      from,
      to: [to],
      created_time: Math.floor(Date.now() / 1000),
      body: { content },
    }
    const t0Ms = Date.now()
    const packed = await agent.packDIDCommMessage({ message, packing: packing ?? 'authcrypt' })
    await agent.sendDIDCommMessage({ packedMessage: packed, recipientDidUrl: to, messageId: message.id })
    return { msgId: message.id, t0Ms, t1Ms: Date.now() }
  },
  async poll({ limit }) {
    needMediator()
    const request = createV3DeliveryRequestMessage(mediation.hostDid, mediatorDid)
    if (limit !== undefined) request.body = { limit }
    const t0Ms = Date.now()
    const reply = await exchange(request)
    const t1Ms = Date.now()
    const items = []
    if (reply?.type === DELIVERY) {
      for (const attachment of reply.attachments ?? []) {
        const got = received.get(attachment.id)
        items.push({ attachmentId: attachment.id, msgId: got?.msgId ?? null, content: got?.content ?? null })
        received.delete(attachment.id)
      }
    }
    return { t0Ms, t1Ms, replyType: reply?.type ?? null, items }
  },
  async status() {
    needMediator()
    const reply = await exchange(createV3StatusRequestMessage(mediation.hostDid, mediatorDid))
    return { replyType: reply?.type ?? null, body: reply?.data ?? null }
  },
}

run(async () => {
  emit({ event: 'ready' })
  await serveCommands(commands)
})
