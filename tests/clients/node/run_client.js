// A trainer written in JavaScript, against trainguard's JSON Schemas only (schemas/json/):
// publishes a run's metrics events, the last with a NaN loss, then prints the first alert the
// worker raises for the run as one JSON line and exits. tests/test_other_clients.py runs it.
// Usage: node run_client.js BOOTSTRAP TOPIC_PREFIX RUN_ID
const { Kafka, logLevel } = require("kafkajs");

async function main() {
  const [bootstrap, prefix, runId] = process.argv.slice(2);
  const kafka = new Kafka({ clientId: "trainguard-node-check", brokers: bootstrap.split(","), logLevel: logLevel.ERROR });
  const consumer = kafka.consumer({ groupId: `node-check-${Date.now()}` });
  await consumer.connect();
  await consumer.subscribe({ topic: `${prefix}.alerts`, fromBeginning: true });
  const alert = new Promise((resolve) => {
    consumer.run({
      eachMessage: async ({ message }) => {
        const event = JSON.parse(message.value.toString());
        if (event.run_id === runId && event.status === "firing") resolve(event);
      },
    });
  });

  // kafkajs's default partitioner is Java's murmur2: the same partition as trainguard's own clients.
  const producer = kafka.producer();
  await producer.connect();
  const source = { kind: "trainer", host: "node-host", rank: 0, gpu: null };
  const messages = [];
  for (let step = 1; step <= 6; step++) {
    const loss = step < 6 ? -0.01 : "NaN"; // non-finite values travel as strings
    const event = { schema: "metrics/1", run_id: runId, source, step, ts: Date.now() / 1000,
                    metrics: { "actor/pg_loss": loss, "actor/kl_loss": 0.001 } };
    messages.push({ key: runId, value: JSON.stringify(event) });
  }
  await producer.send({ topic: `${prefix}.events`, messages });
  await producer.disconnect();

  const timeout = new Promise((_, reject) => setTimeout(() => reject(new Error("no alert within 60 s")), 60000));
  const got = await Promise.race([alert, timeout]);
  console.log(JSON.stringify(got));
  await consumer.disconnect();
}

main().then(() => process.exit(0), (err) => { console.error(`node client: ${err.message}`); process.exit(1); });
