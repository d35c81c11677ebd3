// The Redis client's raw value I/O (redis.hpp's raw_set/raw_get family): large values written from
// and read into their place without hiredis's copies, spread over several connections of a node.
#include "store/redis_impl.hpp"

namespace stagelink::store {

// Runs `part(w, conn)` for each of `ways` parts on its own connection of the node, at once.
// `redirected`: a part met a cluster redirection (the caller falls back to run()).
template <class Part>
static Status spread_raw(Redis::Impl& I, Node& n, unsigned ways, Deadline deadline, bool& redirected, Part&& part) {
  std::vector<Status> st(ways);
  std::vector<char> redir(ways, 0);
  auto one = [&](unsigned w) {
    auto c = I.acquire(n, deadline, false);
    if (!c.ok()) {
      st[w] = std::move(c).error();
      return;
    }
    redisSetTimeout((*c)->c, tv_until(deadline));
    I.round_trips.fetch_add(1, std::memory_order_relaxed);
    bool healthy = false, r = false;
    st[w] = quiet(**c) ? part(w, **c, healthy, r) : make_error(Errc::io, "connection not idle");
    redir[w] = r;
    I.give_back(n, std::move(c).value(), healthy, false);
  };
  std::vector<std::thread> ts;
  for (unsigned w = 1; w < ways; ++w) ts.emplace_back(one, w);
  one(0);
  for (auto& t : ts) t.join();
  redirected = false;
  for (unsigned w = 0; w < ways; ++w) redirected = redirected || redir[w];
  for (auto& s : st)
    if (!s.ok()) return s;
  return {};
}

Status Redis::set_values(std::string_view slot_key, std::span<const SetItem> items, const std::string& px,
                         unsigned ways, Deadline deadline, std::span<const Cmd> then, std::vector<Reply>* then_replies,
                         const std::function<void(size_t)>& sending, bool* sent_each) {
  if (sent_each) *sent_each = false;
  if (items.empty()) return {};
  ways = std::min<unsigned>({std::max(1u, ways), std::max(1u, impl_->o.connections), unsigned(items.size())});
  const bool follow = ways == 1 && !then.empty() && then_replies;  // `then` rides on the same write
  Node* n = impl_->owner(slot_key);
  const size_t per = (items.size() + ways - 1) / ways;
  bool redirected = false;
  Status st = spread_raw(*impl_, *n, ways, deadline, redirected, [&](unsigned w, Conn& conn, bool& healthy, bool& redir) -> Status {
    redisContext* c = conn.c;
    const size_t a = std::min(items.size(), w * per), b = std::min(items.size(), a + per);
    std::vector<std::string> heads(b - a);
    const std::string tail = "\r\n$2\r\nPX\r\n$" + std::to_string(px.size()) + "\r\n" + px + "\r\n";
    const bool each = ways == 1 && sending;  // one by one, the hook ahead of each
    std::vector<iovec> iov;
    for (size_t i = a; i < b; ++i) {
      const SetItem& it = items[i];
      size_t vlen = 0;
      for (auto part : it.value) vlen += part.size();
      heads[i - a] = "*5\r\n$3\r\nSET\r\n$" + std::to_string(it.key.size()) + "\r\n" + it.key + "\r\n$" +
                     std::to_string(vlen) + "\r\n";
      iov.push_back({heads[i - a].data(), heads[i - a].size()});
      for (auto part : it.value)
        if (!part.empty()) iov.push_back({const_cast<std::byte*>(part.data()), part.size()});
      iov.push_back({const_cast<char*>(tail.data()), tail.size()});
      if (each) {
        sending(i);
        SL_TRY(write_all(conn, std::move(iov), n->addr()));
        iov.clear();
      }
    }
    if (each && sent_each) *sent_each = true;
    std::vector<std::unique_ptr<char, void (*)(char*)>> formatted;
    if (follow) {  // formatted now: after the hooks
      std::vector<const char*> av;
      std::vector<size_t> al;
      for (const Cmd& cmd : then) {
        argv_of(cmd, av, al);
        char* out = nullptr;
        const int len = redisFormatCommandArgv(&out, int(av.size()), av.data(), al.data());
        if (len < 0) return make_error(Errc::exhausted, "formatting a command");
        formatted.emplace_back(out, [](char* q) { redisFreeCommand(q); });
        iov.push_back({out, size_t(len)});
      }
    }
    SL_TRY(write_all(conn, std::move(iov), n->addr()));
    RawReader rd(conn, n->addr());
    std::string line, err;
    for (size_t i = a; i < b; ++i) {
      SL_TRY(rd.line(line));
      if (!line.empty() && line[0] == '-' && err.empty()) err = line.substr(1);
    }
    healthy = rd.drained();
    if (follow) {  // the rest through hiredis's reader, fed what was read already
      const std::string_view rest = rd.rest();
      if (!rest.empty() && redisReaderFeed(c->reader, rest.data(), rest.size()) != REDIS_OK)
        return make_error(Errc::io, "redis at " + n->addr() + ": reading replies");
      then_replies->clear();
      for (size_t i = 0; i < then.size(); ++i) {
        void* r = nullptr;
        SL_TRY(next_reply(conn, n->addr(), &r));
        then_replies->emplace_back(static_cast<redisReply*>(r));
      }
      healthy = quiet(conn);
    }
    if (!err.empty()) {
      redir = impl_->o.cluster && redirect_text(err);
      if (redir) return {};
      return make_error(err.rfind("OOM", 0) == 0 ? Errc::exhausted : Errc::io, "redis at " + n->addr() + ": SET: " + err);
    }
    return {};
  });
  if (!st.ok() || redirected) {
    if (then_replies) then_replies->clear();
  }
  if (!redirected || !st.ok()) return st;
  std::vector<Cmd> cmds(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    std::string v;
    for (auto part : items[i].value) v.append(reinterpret_cast<const char*>(part.data()), part.size());
    cmds[i].arg(items[i].key).arg(std::move(v)).arg("PX").arg(px);
  }
  for (auto& c : cmds) c.args.insert(c.args.begin(), std::span<const char>("SET", 3));
  SL_ASSIGN(auto rs, run(slot_key, cmds, deadline));
  for (auto& r : rs)
    if (is_error(r)) return make_error(Errc::io, "redis: SET: " + std::string(str(r)));
  return {};
}

Status Redis::get_values(std::string_view slot_key, std::span<const GetItem> items, bool del, unsigned ways,
                         Deadline deadline, const std::function<void(size_t)>& arrived) {
  if (items.empty()) return {};
  ways = std::min<unsigned>({std::max(1u, ways), std::max(1u, impl_->o.connections), unsigned(items.size())});
  Node* n = impl_->owner(slot_key);
  const size_t per = (items.size() + ways - 1) / ways;
  const char* verb = del ? "GETDEL" : "GET";
  bool redirected = false;
  Status st = spread_raw(*impl_, *n, ways, deadline, redirected, [&](unsigned w, Conn& conn, bool& healthy, bool& redir) -> Status {
    const size_t a = std::min(items.size(), w * per), b = std::min(items.size(), a + per);
    std::string req;
    for (size_t i = a; i < b; ++i)
      req += "*2\r\n$" + std::to_string(std::strlen(verb)) + "\r\n" + verb + "\r\n$" + std::to_string(items[i].key.size()) +
             "\r\n" + items[i].key + "\r\n";
    SL_TRY(write_all(conn, {iovec{req.data(), req.size()}}, n->addr()));
    RawReader rd(conn, n->addr());
    Status first;
    for (size_t i = a; i < b; ++i) {
      std::string err;
      Status s = rd.bulk_into(items[i].dst, err);
      if (s.ok() && !err.empty()) {
        if (impl_->o.cluster && redirect_text(err)) redir = true;
        else s = make_error(Errc::io, "redis at " + n->addr() + ": " + verb + ": " + err);
      }
      if (!s.ok() && s.error().code != Errc::not_found && s.error().code != Errc::corrupt) return s;  // broken
      if (!s.ok() && first.ok()) first = s;
      if (s.ok() && err.empty() && ways == 1 && arrived) arrived(i);
    }
    healthy = rd.drained();
    return redir ? Status{} : first;
  });
  if (!redirected || !st.ok()) return st;
  for (const GetItem& it : items) {  // redirected: the slow path, one value at a time
    Cmd c;
    c.arg(verb).arg(it.key);
    SL_ASSIGN(auto rs, run(slot_key, std::span<const Cmd>(&c, 1), deadline));
    if (is_nil(rs[0])) return make_error(Errc::not_found, "a value is gone");
    if (is_error(rs[0])) return make_error(Errc::io, "redis: " + std::string(str(rs[0])));
    if (str(rs[0]).size() != it.dst.size()) return make_error(Errc::corrupt, "a value in the store has another size");
    std::memcpy(it.dst.data(), str(rs[0]).data(), it.dst.size());
  }
  return {};
}

}  // namespace stagelink::store
