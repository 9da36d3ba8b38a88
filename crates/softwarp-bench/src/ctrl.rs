//! The control channel of `softwarp bench`: a plain TCP connection between the client and
//! the server that carries the test parameters, the memory adverts (address and STag) and
//! the start/stop barriers, one text line per message (`WORD key=value ...`), like
//! perftest's out-of-band exchange. The data itself never goes through it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// How long any single control message may take to arrive.
pub const CTRL_TIMEOUT: Duration = Duration::from_secs(60);

/// One control message: a command word and `key=value` fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Msg {
    /// The command word.
    pub word: String,
    fields: HashMap<String, String>,
}

impl Msg {
    /// A message with no fields.
    pub fn new(word: &str) -> Self {
        Self {
            word: word.to_string(),
            fields: HashMap::new(),
        }
    }

    /// Adds a field (values must not contain spaces).
    pub fn with(mut self, key: &str, value: impl ToString) -> Self {
        self.fields.insert(key.to_string(), value.to_string());
        self
    }

    /// Parses one line.
    pub fn parse(line: &str) -> Result<Self> {
        let mut it = line.split_whitespace();
        let word = it.next().context("empty control message")?.to_string();
        let mut fields = HashMap::new();
        for f in it {
            let (k, v) = f
                .split_once('=')
                .with_context(|| format!("bad control field {f:?}"))?;
            fields.insert(k.to_string(), v.to_string());
        }
        Ok(Self { word, fields })
    }

    fn line(&self) -> String {
        let mut keys: Vec<&String> = self.fields.keys().collect();
        keys.sort();
        let mut s = self.word.clone();
        for k in keys {
            s.push(' ');
            s.push_str(k);
            s.push('=');
            s.push_str(&self.fields[k]);
        }
        s.push('\n');
        s
    }

    /// A field as text.
    pub fn get(&self, key: &str) -> Result<&str> {
        self.fields
            .get(key)
            .map(String::as_str)
            .with_context(|| format!("control message {} lacks {key}", self.word))
    }

    /// A field parsed as a number (or anything `FromStr`).
    pub fn num<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        let v = self.get(key)?;
        v.parse()
            .map_err(|_| anyhow!("control field {key}={v} is not valid"))
    }

    /// Fails unless the message is `word`.
    pub fn expect(self, word: &str) -> Result<Self> {
        if self.word == word {
            Ok(self)
        } else if self.word == "ERR" {
            bail!(
                "the peer failed: {}",
                self.get("why").unwrap_or("(no reason)").replace('_', " ")
            )
        } else {
            bail!("expected control message {word}, got {}", self.word)
        }
    }
}

/// A connected control channel.
#[derive(Debug)]
pub struct Ctrl {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// Bytes of a line received in part by `try_recv`.
    partial: String,
}

impl Ctrl {
    /// Wraps a connected stream.
    pub fn new(stream: TcpStream) -> Result<Self> {
        stream.set_nodelay(true)?;
        let writer = stream.try_clone()?;
        Ok(Self {
            reader: BufReader::new(stream),
            writer,
            partial: String::new(),
        })
    }

    /// Sends one message.
    pub fn send(&mut self, msg: &Msg) -> Result<()> {
        self.writer
            .write_all(msg.line().as_bytes())
            .context("control channel: send")
    }

    /// Sends an error report (best effort).
    pub fn send_err(&mut self, e: &anyhow::Error) {
        let why = format!("{e:#}").replace(char::is_whitespace, "_");
        let _ = self.send(&Msg::new("ERR").with("why", why));
    }

    /// Waits (at most [`CTRL_TIMEOUT`]) for the next message.
    pub fn recv(&mut self) -> Result<Msg> {
        let deadline = Instant::now() + CTRL_TIMEOUT;
        loop {
            if let Some(m) = self.try_recv()? {
                return Ok(m);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("control channel: no message within {CTRL_TIMEOUT:?}");
            }
            self.reader.get_ref().set_nonblocking(false)?;
            self.reader.get_ref().set_read_timeout(Some(left))?;
            match self.reader.fill_buf() {
                Ok([]) => bail!("control channel: the peer closed it"),
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e).context("control channel: receive"),
            }
        }
    }

    /// The next message if a whole one has arrived; never blocks.
    pub fn try_recv(&mut self) -> Result<Option<Msg>> {
        // Take whatever is already buffered first, then what the socket has.
        loop {
            let buffered = self.reader.buffer();
            if let Some(pos) = buffered.iter().position(|&b| b == b'\n') {
                let line = String::from_utf8_lossy(&buffered[..pos]).into_owned();
                self.reader.consume(pos + 1);
                let mut full = std::mem::take(&mut self.partial);
                full.push_str(&line);
                return Msg::parse(&full).map(Some);
            }
            if !buffered.is_empty() {
                let s = String::from_utf8_lossy(buffered).into_owned();
                let n = buffered.len();
                self.partial.push_str(&s);
                self.reader.consume(n);
            }
            self.reader.get_ref().set_nonblocking(true)?;
            let r = self.reader.fill_buf().map(<[u8]>::len);
            self.reader.get_ref().set_nonblocking(false)?;
            match r {
                Ok(0) => bail!("control channel: the peer closed it"),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e).context("control channel: receive"),
            }
        }
    }

    /// Sends `msg` and waits for the answer, which must be `word`.
    pub fn call(&mut self, msg: &Msg, word: &str) -> Result<Msg> {
        self.send(msg)?;
        self.recv()?.expect(word)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_survives_its_line_form() {
        let m = Msg::new("RUN").with("size", 65536).with("iters", 10);
        let back = Msg::parse(m.line().trim_end()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.num::<usize>("size").unwrap(), 65536);
        assert!(back.num::<usize>("nope").is_err());
    }

    #[test]
    fn an_err_message_reads_as_the_peers_failure() {
        let m = Msg::new("ERR").with("why", "bad_thing");
        let e = m.expect("GO").unwrap_err();
        assert!(format!("{e}").contains("bad thing"), "{e}");
    }

    #[test]
    fn messages_split_across_reads_are_reassembled() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let mut c = Ctrl::new(b).unwrap();
        assert!(c.try_recv().unwrap().is_none());
        a.write_all(b"GO x=").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(c.try_recv().unwrap().is_none());
        a.write_all(b"1\nSTOP\n").unwrap();
        assert_eq!(c.recv().unwrap(), Msg::new("GO").with("x", 1));
        assert_eq!(c.recv().unwrap(), Msg::new("STOP"));
    }
}
