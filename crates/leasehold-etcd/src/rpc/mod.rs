//! etcd's gRPC API as this crate speaks it.
//!
//! The messages and clients are generated from `proto/etcd.proto` into `etcdserverpb.rs`
//! and checked in, so building needs no `protoc`; `tests/protocol.rs` regenerates them with
//! a pure-Rust compiler and fails on a difference. [`Rpc`] sends every request with the
//! auth token, and the few builders here make up transactions.

use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tonic::codec::Streaming;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

// Generated: formatted by its generator, compared byte for byte by tests/protocol.rs.
#[rustfmt::skip]
#[allow(
    unreachable_pub,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    clippy::exhaustive_structs
)]
mod etcdserverpb;

pub(crate) use etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
pub(crate) use etcdserverpb::range_request::{SortOrder, SortTarget};
pub(crate) use etcdserverpb::request_op::Request as Op;
pub(crate) use etcdserverpb::response_op::Response as OpAnswer;
pub(crate) use etcdserverpb::watch_create_request::FilterType;
use etcdserverpb::{
    AuthenticateRequest, LeaseGrantRequest, LeaseGrantResponse, LeaseRevokeRequest,
    LeaseTimeToLiveRequest, StatusRequest, WatchCancelRequest, WatchRequest,
    auth_client::AuthClient, kv_client::KvClient, lease_client::LeaseClient,
    maintenance_client::MaintenanceClient, watch_client::WatchClient,
};
pub(crate) use etcdserverpb::{
    Compare, DeleteRangeRequest, KeyValue, LeaseKeepAliveRequest, LeaseKeepAliveResponse,
    LeaseTimeToLiveResponse, PutRequest, RangeRequest, RangeResponse, RequestOp, ResponseOp,
    TxnRequest, TxnResponse, WatchCreateRequest, WatchResponse,
};

/// A connection to an etcd cluster, with the auth token its requests carry.
/// Clones share the connection.
#[derive(Debug, Clone)]
pub(crate) struct Rpc {
    channel: Channel,
    token: Token,
}

/// The auth token etcd handed out for the configured user, if there is one.
#[derive(Debug, Clone, Default)]
struct Token(Option<MetadataValue<Ascii>>);

impl Interceptor for Token {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert("token", token.clone());
        }
        Ok(request)
    }
}

type Authed = InterceptedService<Channel, Token>;

impl Rpc {
    /// A handle on `channel`, signed in as `user` (name, password) if given.
    ///
    /// # Errors
    ///
    /// The status of the authentication request, if there is one and it fails.
    pub(crate) async fn connect(
        channel: Channel,
        user: Option<(&str, &str)>,
    ) -> Result<Self, Status> {
        let mut token = Token::default();
        if let Some((name, password)) = user {
            let answer = AuthClient::new(channel.clone())
                .authenticate(AuthenticateRequest {
                    name: name.to_owned(),
                    password: password.to_owned(),
                })
                .await?
                .into_inner();
            let value = MetadataValue::try_from(answer.token).map_err(|_| {
                Status::internal("etcd answered with an auth token that is not ASCII")
            })?;
            token = Token(Some(value));
        }
        Ok(Self { channel, token })
    }

    /// The KV service, taking replies up to 64 MiB.
    /// A listing's page of 1 000 keys with their values can pass gRPC's default 4 MiB
    /// (etcd itself sends replies of any size).
    fn kv(&self) -> KvClient<Authed> {
        KvClient::with_interceptor(self.channel.clone(), self.token.clone())
            .max_decoding_message_size(64 << 20)
    }

    fn lease(&self) -> LeaseClient<Authed> {
        LeaseClient::with_interceptor(self.channel.clone(), self.token.clone())
    }

    /// Asks a member for its status: the cheapest request that proves the link works.
    pub(crate) async fn status(&self) -> Result<(), Status> {
        MaintenanceClient::with_interceptor(self.channel.clone(), self.token.clone())
            .status(StatusRequest {})
            .await
            .map(drop)
    }

    /// Reads the keys `request` names.
    pub(crate) async fn range(&self, request: RangeRequest) -> Result<RangeResponse, Status> {
        Ok(self.kv().range(request).await?.into_inner())
    }

    /// Writes one key, answering with the revision it was written at.
    pub(crate) async fn put(&self, request: PutRequest) -> Result<i64, Status> {
        let answer = self.kv().put(request).await?.into_inner();
        Ok(answer.header.map_or(0, |h| h.revision))
    }

    /// Runs one transaction.
    pub(crate) async fn txn(&self, request: TxnRequest) -> Result<TxnResponse, Status> {
        Ok(self.kv().txn(request).await?.into_inner())
    }

    /// Grants a lease of `ttl` seconds.
    pub(crate) async fn lease_grant(&self, ttl: i64) -> Result<LeaseGrantResponse, Status> {
        let request = LeaseGrantRequest { ttl, id: 0 };
        Ok(self.lease().lease_grant(request).await?.into_inner())
    }

    /// Revokes lease `id`, deleting every key bound to it.
    pub(crate) async fn lease_revoke(&self, id: i64) -> Result<(), Status> {
        self.lease()
            .lease_revoke(LeaseRevokeRequest { id })
            .await
            .map(drop)
    }

    /// The time lease `id` has left.
    pub(crate) async fn lease_time_to_live(
        &self,
        id: i64,
    ) -> Result<LeaseTimeToLiveResponse, Status> {
        let request = LeaseTimeToLiveRequest { id };
        Ok(self.lease().lease_time_to_live(request).await?.into_inner())
    }

    /// Opens a keep-alive stream for lease `id`, with its first keep-alive sent.
    /// Each later one is a send on the returned sender; the stream answers each in turn.
    /// (etcd answers a new stream only once it has a request to answer.)
    pub(crate) async fn lease_keep_alive(
        &self,
        id: i64,
    ) -> Result<(KeepAlive, Streaming<LeaseKeepAliveResponse>), Status> {
        let (sender, requests) = mpsc::channel(1);
        let keep_alive = KeepAlive { id, sender };
        keep_alive.send()?;
        let answers = self
            .lease()
            .lease_keep_alive(ReceiverStream::new(requests))
            .await?
            .into_inner();
        Ok((keep_alive, answers))
    }

    /// Opens a watch stream with one watch per request in `watches`.
    /// The stream lives as long as the returned value: dropping it resets the stream, and
    /// etcd then cancels its watches. Its requests queue unbounded, so that adding or
    /// canceling a watch never waits on etcd, which may itself wait for its answers to be
    /// read.
    pub(crate) async fn watch(&self, watches: Vec<WatchCreateRequest>) -> Result<Watching, Status> {
        let (sender, requests) = mpsc::unbounded_channel();
        for watch in watches {
            // The receiver is still here: the send cannot fail.
            let _ = sender.send(create_request(watch));
        }
        // Replies up to 64 MiB, as for reads: a change feed's watch can be sent the events of
        // many revisions at once.
        let answers = WatchClient::with_interceptor(self.channel.clone(), self.token.clone())
            .max_decoding_message_size(64 << 20)
            .watch(UnboundedReceiverStream::new(requests))
            .await?
            .into_inner();
        Ok(Watching {
            requests: sender,
            answers,
        })
    }
}

/// The request that creates `watch`.
fn create_request(watch: WatchCreateRequest) -> WatchRequest {
    WatchRequest {
        request_union: Some(etcdserverpb::watch_request::RequestUnion::CreateRequest(
            watch,
        )),
    }
}

/// The sending half of a keep-alive stream.
#[derive(Debug)]
pub(crate) struct KeepAlive {
    id: i64,
    sender: mpsc::Sender<LeaseKeepAliveRequest>,
}

impl KeepAlive {
    /// Sends one keep-alive, without waiting.
    ///
    /// # Errors
    ///
    /// If the stream has ended, or has not yet taken the keep-alive before this one (a
    /// stalled connection): open a new stream.
    pub(crate) fn send(&self) -> Result<(), Status> {
        self.sender
            .try_send(LeaseKeepAliveRequest { id: self.id })
            .map_err(|_| Status::unavailable("the keep-alive stream takes no more requests"))
    }
}

/// An open watch stream: its answers, and the request side that keeps it open.
#[derive(Debug)]
pub(crate) struct Watching {
    requests: mpsc::UnboundedSender<WatchRequest>,
    pub(crate) answers: Streaming<WatchResponse>,
}

impl Watching {
    /// Adds `watch` to the stream, without waiting; etcd answers it as created (or canceled).
    /// Returns `false` if the stream is gone.
    pub(crate) fn create(&self, watch: WatchCreateRequest) -> bool {
        self.requests.send(create_request(watch)).is_ok()
    }

    /// Cancels the stream's watch `watch_id`, without waiting.
    /// Returns `false` if the stream is gone.
    pub(crate) fn cancel(&self, watch_id: i64) -> bool {
        let request = WatchRequest {
            request_union: Some(etcdserverpb::watch_request::RequestUnion::CancelRequest(
                WatchCancelRequest { watch_id },
            )),
        };
        self.requests.send(request).is_ok()
    }
}

/// A comparison of `key`'s `target` that passes on `result`.
/// The target is a create revision, mod revision, value, version or lease.
pub(crate) fn compare(
    key: impl Into<Vec<u8>>,
    result: CompareResult,
    target: TargetUnion,
) -> Compare {
    let kind = match target {
        TargetUnion::Version(_) => CompareTarget::Version,
        TargetUnion::CreateRevision(_) => CompareTarget::Create,
        TargetUnion::ModRevision(_) => CompareTarget::Mod,
        TargetUnion::Value(_) => CompareTarget::Value,
        TargetUnion::Lease(_) => CompareTarget::Lease,
    };
    Compare {
        result: result.into(),
        target: kind.into(),
        key: key.into(),
        target_union: Some(target),
        range_end: Vec::new(),
    }
}

impl From<RangeRequest> for RequestOp {
    fn from(request: RangeRequest) -> Self {
        Self {
            request: Some(Op::RequestRange(request)),
        }
    }
}

impl From<PutRequest> for RequestOp {
    fn from(request: PutRequest) -> Self {
        Self {
            request: Some(Op::RequestPut(request)),
        }
    }
}

impl From<DeleteRangeRequest> for RequestOp {
    fn from(request: DeleteRangeRequest) -> Self {
        Self {
            request: Some(Op::RequestDeleteRange(request)),
        }
    }
}

impl From<TxnRequest> for RequestOp {
    fn from(request: TxnRequest) -> Self {
        Self {
            request: Some(Op::RequestTxn(request)),
        }
    }
}

impl TxnResponse {
    /// The store's revision when the transaction was applied; 0 if the answer lacks it.
    pub(crate) fn revision(&self) -> i64 {
        self.header.map_or(0, |h| h.revision)
    }
}
