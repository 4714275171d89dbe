package dev.trainguard.client;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import java.util.TreeSet;
import java.util.UUID;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * A trainer written in Java, against trainguard's JSON Schemas only (schemas/json/), on Apache
 * Kafka's own client with its default partitioner (murmur2 of the key, the run id).
 *
 * <pre>
 * run BOOTSTRAP TOPIC_PREFIX RUN_ID
 *     publishes six metrics/1 events of the run, the last with a NaN loss, prints
 *     {"sent": 6, "partitions": [...]} and then the first firing alert of the run, one JSON line
 *     each; exits 1 when no alert comes within 60 s.
 * partitions BOOTSTRAP TOPIC KEY...
 *     publishes one metrics/1 event keyed by each KEY and prints {KEY: partition, ...}, the
 *     partitions the broker acknowledged.
 * </pre>
 *
 * tests/test_other_clients.py runs both.
 */
public final class JavaTrainer {
    private static final ObjectMapper JSON = new ObjectMapper();
    private static final Duration ALERT_TIMEOUT = Duration.ofSeconds(60);

    private JavaTrainer() {}

    public static void main(String[] args) throws Exception {
        if (args.length >= 4 && args[0].equals("run")) {
            System.exit(run(args[1], args[2], args[3]));
        } else if (args.length >= 4 && args[0].equals("partitions")) {
            List<String> keys = new ArrayList<>(List.of(args).subList(3, args.length));
            System.exit(partitions(args[1], args[2], keys));
        }
        System.err.println("usage: JavaTrainer run BOOTSTRAP TOPIC_PREFIX RUN_ID\n"
                + "       JavaTrainer partitions BOOTSTRAP TOPIC KEY...");
        System.exit(2);
    }

    /** One metrics/1 event; non-finite values travel as the strings NaN, Infinity, -Infinity. */
    static ObjectNode metrics(String runId, long step, boolean nanLoss) {
        ObjectNode event = JSON.createObjectNode();
        event.put("schema", "metrics/1");
        event.put("run_id", runId);
        ObjectNode source = event.putObject("source");
        source.put("kind", "trainer");
        source.put("host", "java-host");
        source.put("rank", 0);
        source.putNull("gpu");
        event.put("step", step);
        event.put("ts", System.currentTimeMillis() / 1000.0);
        ObjectNode values = event.putObject("metrics");
        if (nanLoss) {
            values.put("actor/pg_loss", "NaN");
        } else {
            values.put("actor/pg_loss", -0.01);
        }
        values.put("actor/kl_loss", 0.001);
        return event;
    }

    /** A producer with the client's defaults, the partitioner among them: no partitioner is set. */
    static KafkaProducer<String, String> producer(String bootstrap) {
        Properties props = new Properties();
        props.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(ProducerConfig.CLIENT_ID_CONFIG, "trainguard-java-check");
        props.put(ProducerConfig.ACKS_CONFIG, "all");
        return new KafkaProducer<>(props, new StringSerializer(), new StringSerializer());
    }

    static int run(String bootstrap, String prefix, String runId) throws Exception {
        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(ConsumerConfig.GROUP_ID_CONFIG, "java-check-" + UUID.randomUUID());
        props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        try (KafkaConsumer<String, String> consumer =
                     new KafkaConsumer<>(props, new StringDeserializer(), new StringDeserializer())) {
            consumer.subscribe(List.of(prefix + ".alerts"));

            TreeSet<Integer> partitions = new TreeSet<>();
            try (KafkaProducer<String, String> producer = producer(bootstrap)) {
                List<java.util.concurrent.Future<RecordMetadata>> sent = new ArrayList<>();
                for (long step = 1; step <= 6; step++) {
                    String value = JSON.writeValueAsString(metrics(runId, step, step == 6));
                    sent.add(producer.send(new ProducerRecord<>(prefix + ".events", runId, value)));
                }
                for (var future : sent) {
                    partitions.add(future.get().partition());
                }
            }
            ObjectNode receipt = JSON.createObjectNode();
            receipt.put("sent", 6);
            partitions.forEach(receipt.putArray("partitions")::add);
            System.out.println(JSON.writeValueAsString(receipt));

            long deadline = System.nanoTime() + ALERT_TIMEOUT.toNanos();
            while (System.nanoTime() < deadline) {
                for (ConsumerRecord<String, String> record : consumer.poll(Duration.ofMillis(200))) {
                    JsonNode alert;
                    try {
                        alert = JSON.readTree(record.value());
                    } catch (Exception notJson) {
                        continue; // a record that is not an alert is not ours to judge
                    }
                    if (alert != null && runId.equals(alert.path("run_id").asText(null))
                            && "firing".equals(alert.path("status").asText(null))) {
                        System.out.println(JSON.writeValueAsString(alert));
                        return 0;
                    }
                }
            }
        }
        System.err.println("java client: no alert within " + ALERT_TIMEOUT.toSeconds() + " s");
        return 1;
    }

    static int partitions(String bootstrap, String topic, List<String> keys) throws Exception {
        ObjectNode placed = JSON.createObjectNode();
        try (KafkaProducer<String, String> producer = producer(bootstrap)) {
            for (String key : keys) {
                String value = JSON.writeValueAsString(metrics(key, 1, false));
                placed.put(key, producer.send(new ProducerRecord<>(topic, key, value)).get().partition());
            }
        }
        System.out.println(JSON.writeValueAsString(placed));
        return 0;
    }
}
