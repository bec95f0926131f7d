//! Just enough of each server's protocol to tell whether it serves and to administer it.
//! RESP for Redis, HTTP/1.0 for etcd's health endpoint, four-letter words for ZooKeeper.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A Redis reply, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    /// A simple string: `+OK`.
    Simple(String),
    /// `-ERR ...`
    Error(String),
    /// An integer: `:42`.
    Integer(i64),
    /// A bulk string: `$5 hello` (`None`: null bulk).
    Bulk(Option<Vec<u8>>),
    /// An array: `*2 ...` (`None`: null array).
    Array(Option<Vec<Resp>>),
}

impl Resp {
    /// The reply as text: simple strings, errors, integers and bulk strings.
    pub fn text(&self) -> Option<String> {
        match self {
            Resp::Simple(s) | Resp::Error(s) => Some(s.clone()),
            Resp::Integer(i) => Some(i.to_string()),
            Resp::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }
}

/// Sends one Redis command on a new connection and reads its reply.
pub async fn redis_command(addr: SocketAddr, args: &[&str]) -> io::Result<Resp> {
    let mut replies = redis_commands(addr, &[args]).await?;
    replies
        .pop()
        .ok_or_else(|| io::Error::other("no reply from redis"))
}

/// Sends commands one after another on one connection and reads every reply.
/// On one connection `WAIT`, for example, sees the writes before it.
pub async fn redis_commands(addr: SocketAddr, commands: &[&[&str]]) -> io::Result<Vec<Resp>> {
    tokio::time::timeout(PROBE_TIMEOUT, async {
        let stream = TcpStream::connect(addr).await?;
        let mut stream = BufReader::new(stream);
        let mut replies = Vec::with_capacity(commands.len());
        for args in commands {
            let mut request = format!("*{}\r\n", args.len()).into_bytes();
            for arg in *args {
                request.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
                request.extend_from_slice(arg.as_bytes());
                request.extend_from_slice(b"\r\n");
            }
            stream.get_mut().write_all(&request).await?;
            replies.push(read_resp(&mut stream).await?);
        }
        Ok(replies)
    })
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no reply from redis"))?
}

fn read_resp(
    stream: &mut BufReader<TcpStream>,
) -> std::pin::Pin<Box<dyn Future<Output = io::Result<Resp>> + Send + '_>> {
    Box::pin(async move {
        let mut line = String::new();
        if stream.read_line(&mut line).await? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "redis closed"));
        }
        let line = line.trim_end_matches("\r\n");
        let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("bad reply {line:?}"));
        let (kind, rest) = line.split_at_checked(1).ok_or_else(bad)?;
        Ok(match kind {
            "+" => Resp::Simple(rest.to_owned()),
            "-" => Resp::Error(rest.to_owned()),
            ":" => Resp::Integer(rest.parse().map_err(|_| bad())?),
            "$" => {
                let len: i64 = rest.parse().map_err(|_| bad())?;
                if len < 0 {
                    Resp::Bulk(None)
                } else {
                    let mut data = vec![0; len as usize + 2];
                    stream.read_exact(&mut data).await?;
                    data.truncate(len as usize);
                    Resp::Bulk(Some(data))
                }
            }
            "*" => {
                let len: i64 = rest.parse().map_err(|_| bad())?;
                if len < 0 {
                    Resp::Array(None)
                } else {
                    let mut items = Vec::with_capacity(len as usize);
                    for _ in 0..len {
                        items.push(read_resp(stream).await?);
                    }
                    Resp::Array(Some(items))
                }
            }
            _ => return Err(bad()),
        })
    })
}

/// `GET path` over HTTP/1.0; the response body.
pub async fn http_get(addr: SocketAddr, path: &str) -> io::Result<String> {
    tokio::time::timeout(PROBE_TIMEOUT, async {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        Ok(response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default())
    })
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no HTTP reply"))?
}

/// Sends a ZooKeeper four-letter word (`srvr`, `stat`, ...) and reads the answer.
pub async fn zookeeper_word(addr: SocketAddr, word: &str) -> io::Result<String> {
    tokio::time::timeout(PROBE_TIMEOUT, async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(word.as_bytes()).await?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await?;
        Ok(answer)
    })
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer from zookeeper"))?
}
